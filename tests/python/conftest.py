"""pytest hooks for the kvcache suite: the end of a run says why tests were skipped.

Most skips are expected on a developer's machine (the CUDA tests without a GPU, the ISA paths
this CPU lacks, optional packages); a bare "698 skipped" hides which, so the summary groups the
skips by reason, largest group first.
"""

from __future__ import annotations

import collections


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    reasons = collections.Counter()
    for report in skipped:
        longrepr = report.longrepr
        # A skip's longrepr is (path, line, "Skipped: <reason>").
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        reason = reason.removeprefix("Skipped: ").strip().splitlines()[0] if reason.strip() else "(no reason)"
        reasons[reason[:110]] += 1
    terminalreporter.write_sep("-", f"{len(skipped)} skipped, by reason (expected without a GPU or "
                                    "on a CPU without that instruction set)")
    shown = reasons.most_common(12)
    for reason, count in shown:
        terminalreporter.write_line(f"{count:6d}  {reason}")
    rest = sum(reasons.values()) - sum(c for _, c in shown)
    if rest:
        terminalreporter.write_line(f"{rest:6d}  (other reasons: pytest -rs lists every skip)")
