"""The ``ortcapture selftest`` cases as a pytest module, for people who build ORT with ortcapture's patches.

Run against the ORT installed in the current interpreter::

    pytest --pyargs ortcapture.cli.selftest_cases -v

Each case runs in a child process (see :mod:`ortcapture.cli.selftest`): "present" passes, "missing" fails with the
evidence, "not testable" skips (no WebGPU adapter, no CUDA+WebGPU build), and a failed child is an error.
"""
from __future__ import annotations

import pytest

from ortcapture.cli.selftest import CASES, run_case


@pytest.mark.parametrize("case", list(CASES))
def test_fix_is_present(case):
    r = run_case(case)
    if r["result"] == "not testable":
        pytest.skip(f"{case}: {r['evidence']}")
    assert r["result"] != "error", f"{case}: the case failed: {r['evidence']}"
    assert r["result"] == "present", f"{CASES[case]} is missing: {r['evidence']}"
