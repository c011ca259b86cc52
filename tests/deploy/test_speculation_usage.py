"""A request's drafts in its usage: several choices' counts add up (HTTP), and gRPC's Usage carries them."""
from raymoe.deploy.grpc_service import usage_pb
from raymoe.deploy.openai_api import total_usage
from raymoe.stages.runtime.speculation import speculation_load


def result(completion: int, drafts=None) -> dict:
    usage = {"prompt_tokens": 5, "completion_tokens": completion, "cached_tokens": 2}
    if drafts:
        usage["speculation"] = speculation_load(*drafts)
    return {"usage": usage}


def test_choices_drafts_add_up_and_none_means_no_field():
    usage = total_usage([result(10, (6, 4, 3)), result(8, (2, 0, 2)), result(3)])
    assert usage["completion_tokens"] == 21 and usage["prompt_tokens_details"] == {"cached_tokens": 2}
    assert usage["speculation"] == {"draft_tokens": 8, "accepted_tokens": 4, "verify_steps": 5,
                                    "acceptance_rate": 0.5, "mean_accepted_length": 1.8}
    assert "speculation" not in total_usage([result(3)])


def test_grpc_usage_carries_the_drafts():
    got = usage_pb(result(10, (6, 4, 3))["usage"])
    assert (got.draft_tokens, got.accepted_draft_tokens, got.verify_steps) == (6, 4, 3)
    assert (got.completion_tokens, got.cached_tokens) == (10, 2)
    assert usage_pb(result(3)["usage"]).draft_tokens == 0
