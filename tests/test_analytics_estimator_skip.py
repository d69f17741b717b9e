"""The one rule for "SGLang's estimator recorder skips this request", held to SGLang's code.

SGLang 0.5.23 normalizes sampling settings in ``SamplingParams.__post_init__`` (run here from
the wheel's source) and its recorder then drops rows whose ``greedy_mask`` (top_ks <= 1) or
``truncated_sampling_mask`` (top_ks != TOP_K_ALL | top_ps != 1.0 in float32) is set.
"""

from __future__ import annotations

import ast
from typing import Any

import numpy as np
import pandas as pd
import pytest
from sglang_wheel import _no_sglang_imports

from dspark_obs.analytics.estimator import sglang_skipped_rows
from dspark_obs.analytics.estimator_recorder import sglang_skip_mask, sglang_skips_estimator

SAMPLING = "sglang/srt/sampling/sampling_params.py"

SETTINGS = [
    (t, k, p)
    for t in (0.0, 5e-7, 1e-6, 0.7, 1.0)
    for k in (-1, 1, 2, 20, 1 << 30)
    for p in (0.9, 0.999999, 0.99999999, 1.0)
]


@pytest.fixture(scope="module")
def sglang_sampling(sglang_wheel: Any) -> dict[str, Any]:
    tree = _no_sglang_imports(ast.parse(sglang_wheel.source(SAMPLING)))
    ns: dict[str, Any] = {"__name__": "sglang_wheel.sampling_params"}
    ns["WatermarkRequestConfig"] = dict
    ns["normalize_watermark_request"] = lambda w: w
    exec(compile(ast.fix_missing_locations(tree), f"<wheel>/{SAMPLING}", "exec"), ns)
    return ns


def _sglang_skips(ns: dict[str, Any], t: float, k: int, p: float) -> bool:
    sp = ns["SamplingParams"](temperature=t, top_k=k, top_p=p)
    top_k = np.int32(sp.top_k)  # SamplingBatchInfo: torch.int32 / torch.float tensors
    top_p = np.float32(sp.top_p)
    greedy = top_k <= 1
    truncated = (top_k != ns["TOP_K_ALL"]) | (top_p != 1.0) | (sp.min_p > 0)
    return bool(greedy or truncated)


def test_predicate_matches_sglang_normalization(sglang_sampling: dict[str, Any]) -> None:
    for t, k, p in SETTINGS:
        want = _sglang_skips(sglang_sampling, t, k, p)
        assert sglang_skips_estimator(t, k, p) == want, (t, k, p)


def test_pure_temperature_is_the_only_recorded_kind() -> None:
    assert not sglang_skips_estimator(1.0, -1, 1.0)
    assert not sglang_skips_estimator(0.7, -1, 1.0)
    assert sglang_skips_estimator(0.0, -1, 1.0)  # greedy
    assert sglang_skips_estimator(1.0, 20, 1.0)  # top-k
    assert sglang_skips_estimator(1.0, 1, 1.0)  # top-k 1 is greedy
    assert sglang_skips_estimator(1.0, -1, 0.9)  # top-p


@pytest.mark.parametrize(
    ("t", "k", "p", "word"),
    [
        (-0.1, -1, 1.0, "temperature"),
        (float("nan"), -1, 1.0, "temperature"),
        (1.0, 0, 1.0, "top_k"),
        (1.0, -2, 1.0, "top_k"),
        (1.0, 2.5, 1.0, "top_k"),
        (1.0, -1, 0.0, "top_p"),
        (1.0, -1, 1.5, "top_p"),
        (1.0, -1, float("nan"), "top_p"),
    ],
)
def test_settings_sglang_refuses_are_errors(t: float, k: Any, p: float, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        sglang_skips_estimator(t, k, p)


def test_frame_rows_use_the_same_rule() -> None:
    df = pd.DataFrame(SETTINGS, columns=["temperature", "top_k", "top_p"])
    want = [sglang_skips_estimator(t, k, p) for t, k, p in SETTINGS]
    assert sglang_skipped_rows(df).tolist() == want
    # the schema's float32 top_p / int32 top_k give the same answer (SGLang compares top_p in
    # float32 too); a temperature of exactly 1e-6 does not survive float32, so it stays float64
    df32 = df.astype({"top_p": np.float32, "top_k": np.int32})
    assert sglang_skipped_rows(df32).tolist() == want


def test_absent_columns_skip_nothing() -> None:
    assert not sglang_skipped_rows(pd.DataFrame({"rid": ["a", "b"]})).any()
    nan = np.array([np.nan, np.nan])
    assert not sglang_skip_mask(nan, nan, nan).any()
    only_t = pd.DataFrame({"temperature": [0.0, 1.0]})
    assert sglang_skipped_rows(only_t).tolist() == [True, False]
