"""agent/labelselector.py: the selectors kube-apiserver accepts and the ones it refuses with 400 (each also sent to a
real 1.37 in tests/realkube/test_realkube_vs_double.py)."""

from __future__ import annotations

import pytest

from agent.labelselector import label_selector_problem


@pytest.mark.parametrize(
    "selector",
    [
        "",
        "node-role.kubernetes.io/accelerator",
        "!node.kubernetes.io/exclude",
        "accel=true",
        "accel==true, pool!=cpu",
        "accel in (npu, gpu),zone notin (a)",
        "empty=",
    ],
)
def test_selectors_the_api_server_parses(selector: str) -> None:
    assert label_selector_problem(selector) == ""


@pytest.mark.parametrize(
    "selector,problem",
    [
        ("accel=true,", "a trailing comma"),
        ("accel===true", "cannot parse"),
        ("-bad=x", "is not a label key"),
        ("accel=a b", "cannot parse"),
        ("accel=" + "v" * 64, "is not a label value"),
        ("accel in (a,-b)", "is not a label value"),
        ("accel in a", "cannot parse"),
    ],
)
def test_selectors_the_api_server_refuses_name_their_problem(selector: str, problem: str) -> None:
    assert problem in label_selector_problem(selector)
