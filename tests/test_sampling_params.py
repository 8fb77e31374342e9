"""`SamplingParams`: every out-of-range value is an `invalid_row` naming its field (a row's
override may carry any of them), and a job's parameters survive the manifest's JSON."""

from __future__ import annotations

import json

import pytest

from vlmbatch.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from vlmbatch.errors import ErrorType, RowError
from vlmbatch.structured.spec import parse_structured_output


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("max_tokens", 0, "max_tokens must be a positive integer"),
        ("max_tokens", "8", "max_tokens must be a positive integer"),
        ("temperature", -0.1, "temperature must be a finite number >= 0"),
        ("temperature", float("nan"), "temperature must be a finite number >= 0"),
        ("temperature", float("inf"), "temperature must be a finite number >= 0"),
        ("top_p", 0, "top_p must be in (0, 1]"),
        ("top_p", 1.5, "top_p must be in (0, 1]"),
        ("top_k", 2.5, "top_k must be an integer"),
        ("seed", 1.5, "seed must be an integer"),
        ("n", 0, "n must be a positive integer"),
        ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2]"),
        ("frequency_penalty", "high", "frequency_penalty must be in [-2, 2]"),
        ("repetition_penalty", 0, "repetition_penalty must be a finite number > 0"),
        ("repetition_penalty", float("inf"), "repetition_penalty must be a finite number > 0"),
        ("stop", [None], "stop must be non-empty strings"),
        ("stop", ("###", ""), "stop must be non-empty strings"),
        ("min_tokens", 9, "min_tokens must be an integer in [0, max_tokens]"),
        ("logprobs", MAX_LOGPROBS + 1, f"logprobs must be an integer in [0, {MAX_LOGPROBS}]"),
        ("logit_bias", {"5": 101}, "logit_bias must map token ids to numbers in [-100, 100]"),
        ("logit_bias", {"-1": 1}, "logit_bias must map token ids"),
        ("logit_bias", {"x": 1}, "logit_bias must map token ids"),
        ("structured_output", "json", "structured_output must be a StructuredOutput"),
    ],
)  # fmt: skip
def test_each_bad_value_is_an_invalid_row_naming_its_field(field: str, value, message: str) -> None:
    with pytest.raises(RowError) as info:
        SamplingParams(**{"max_tokens": 8, field: value})
    assert info.value.error_type == ErrorType.INVALID_ROW and message in info.value.message


def test_every_problem_of_a_row_is_named_at_once() -> None:
    with pytest.raises(RowError) as info:
        SamplingParams(max_tokens=4, temperature=-1, top_p=3)
    assert "temperature" in info.value.message and "top_p" in info.value.message


def test_logit_bias_tokens_must_be_in_the_vocabulary() -> None:
    params = SamplingParams(logit_bias={3: 5.0, 70: -100})
    params.check_vocabulary(71)
    with pytest.raises(RowError) as info:
        params.check_vocabulary(70)
    assert info.value.param == "logit_bias" and "[70]" in info.value.message


def test_the_manifests_json_round_trip_keeps_every_parameter() -> None:
    spec = parse_structured_output({"guided_choice": ["yes", "no"]})
    params = SamplingParams(max_tokens=7, temperature=0.7, top_p=0.9, top_k=5, seed=3, stop="###", n=2,
                            presence_penalty=0.5, repetition_penalty=1.1, min_tokens=2, logit_bias={"11": -100, 4: 2.5},
                            logprobs=3, structured_output=spec)  # fmt: skip
    restored = SamplingParams(**json.loads(json.dumps(params.to_dict())))
    assert restored == params
    assert restored.stop == ("###",) and restored.logit_bias == ((4, 2.5), (11, -100.0)) and restored.adjusts_logits
    assert "structured_output" not in SamplingParams().to_dict()  # unconstrained manifests stay as they were
