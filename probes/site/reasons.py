"""What a site check can say, beside OK: the command's own verdict (exit 1 warn, 2 fail) and every way it can fail
to give one (unknown)."""

from __future__ import annotations

from probes.base import Reason, Status

_SEE = "run the command on the node by hand; the site's own docs say what it checks"

SITE_WARN = Reason("SiteCheckWarn", Status.WARN, "a site check's command exited 1 (warn)", _SEE)
SITE_FAIL = Reason("SiteCheckFailed", Status.FAIL, "a site check's command exited 2 (fail)", _SEE)
SITE_UNKNOWN_EXIT = Reason(
    "SiteCheckBadExit",
    Status.UNKNOWN,
    "a site check's command exited with a status other than 0, 1 or 2",
    "the command broke before it could judge: run it by hand and fix it (0 ok, 1 warn, 2 fail)",
)
SITE_TIMEOUT = Reason(
    "SiteCheckTimeout",
    Status.UNKNOWN,
    "a site check's command did not exit by its deadline (timeout_seconds): its process group was killed",
    "find what the command waits on (a hung mount, a tool that hangs), or give it a longer timeout_seconds",
)
SITE_KILLED = Reason(
    "SiteCheckKilled",
    Status.UNKNOWN,
    "a site check's command was killed by a signal (the OOM killer, an operator)",
    "see the node's kernel log (OOM) and run the command by hand",
)
SITE_OUTPUT_CAPPED = Reason(
    "SiteCheckOutputCapped",
    Status.UNKNOWN,
    "a site check's command wrote more than output_cap_bytes: it was killed before it could exit",
    "make the command print one line (its first line is the message), or raise output_cap_bytes",
)
SITE_NOT_RUNNABLE = Reason(
    "SiteCheckNotRunnable",
    Status.UNKNOWN,
    "a site check's command could not be started (not found, not executable)",
    "install the command on every node the agent runs on, at the path the config names, executable",
)

SITE_REASONS = (
    SITE_WARN,
    SITE_FAIL,
    SITE_UNKNOWN_EXIT,
    SITE_TIMEOUT,
    SITE_KILLED,
    SITE_OUTPUT_CAPPED,
    SITE_NOT_RUNNABLE,
)
