"""The coordinator's updates for a scripted output, as the serving code receives them (the stream tests)."""
from raymoe.stages.runtime.sequence import Sequence
from raymoe.stages.text.sampling_params import SamplingParams


def engine_updates(tok, prompt_ids, output_ids, bounds, stops=(), **params):
    """The coordinator's updates for output_ids, grouped into updates ending at the indices in bounds."""
    params = SamplingParams.from_dict({"max_tokens": len(output_ids), "stop": list(stops), "temperature": 0, **params})
    seq = Sequence(0, "r", prompt_ids, params, tok, set(tok.eos_token_ids), 1 << 20)
    updates, pending, sent = [], [], 0
    for i, token in enumerate(output_ids):
        seq.append_token(token)
        pending.append(token)
        if seq.finish_reason is not None:
            updates.append({"token_ids": pending, "text_delta": seq.text[sent:], "logprobs": None,
                            "finished": seq.result()})
            return updates
        if i in bounds:
            updates.append({"token_ids": pending, "text_delta": seq.text[sent:], "logprobs": None})
            pending, sent = [], len(seq.text)
    raise AssertionError("the sequence did not finish")
