"""One pipeline stage at run time: the Stage, the in-process engine, scheduling, sequences, batches, memory
planning, sampling."""
