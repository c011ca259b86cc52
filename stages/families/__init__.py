"""Model families: the `Family` contract (contract.py), one module per family (and its HF adapter), the registry."""
