"""tools.bench_mtp on the embedded model: the head's drafts are kept at a real rate with a fixed draft length, and the
report has the decode ratio with its spread."""
import json

from raymoe.tools import bench_mtp


def test_reports_the_heads_acceptance_and_the_decode_ratio(capsys):
    assert bench_mtp.main(["--tokens", "12", "--repeat", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    fixed = report["raymoe_fixed_total"]
    assert fixed["draft_tokens"] > 0 and 0.2 < fixed["acceptance_rate"] < 1
    assert len(report["raymoe_fixed"]) == len(bench_mtp.PROMPTS) and "llama_cpp_fixed" not in report
    ratio = report["decode_with_mtp_over_without"]
    assert ratio["min"] <= ratio["median"] <= ratio["max"] and ratio["min"] > 0
