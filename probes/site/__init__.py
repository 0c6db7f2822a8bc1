"""Site checks: operator-owned commands from the config's `site_checks:` list, each a check `site.<name>` that
counts under the category the operator gives it (docs/probes/site.md).

Modules: `config` (the list's model and its limits), `reasons` (what a run can say), `site` (the probe: every
command run on its own interval, in parallel, with its deadline and output cap; exit 0 ok, 1 warn, 2 fail,
anything else unknown).
"""

from __future__ import annotations

from probes.family import Family, register_family
from probes.site.config import SiteChecksConfig

FAMILY = register_family(
    Family(
        key="site_checks",
        module=__name__,
        config=SiteChecksConfig,
        title="Site checks",
        doc="docs/probes/site.md",
        order=90,
    )
)
