"""The interconnect family's reason codes (docs/probes/interconnect.md)."""

from __future__ import annotations

from probes.base import Reason, Status

HCA_PORT_DOWN = Reason(
    "HcaPortDown",
    Status.FAIL,
    "an HCA port is not ACTIVE/LinkUp (state or phys_state)",
    "check the cable and the switch port (`ibstat`, `ibstatus`); a port stuck in INIT waits for the subnet "
    "manager (`sminfo`), one in Polling/Disabled has no link partner: reseat or replace the cable or transceiver",
)
HCA_PORT_MISSING = Reason(
    "HcaPortMissing",
    Status.FAIL,
    "a port in interconnect.expected_ports is not in /sys/class/infiniband",
    "the HCA or its driver is missing: `lspci | grep -i mellanox`, `dmesg | grep mlx5`; load the driver "
    "(mlx5_ib) or replace the card; fix interconnect.expected_ports if the node has other HCAs",
)
HCA_PORT_DEGRADED = Reason(
    "HcaPortDegraded",
    Status.WARN,
    "an HCA port runs below interconnect.expected_rate_gbps (status per interconnect.degraded_status)",
    "the link trained at a lower rate or width (a bad lane, cable or transceiver): compare `ibstat` with the "
    "switch port, reseat or replace the cable",
    also=(Status.FAIL,),
)
HCA_PORT_FLAPPING = Reason(
    "HcaPortFlapping",
    Status.FAIL,
    "link_downed + link_error_recovery rose by interconnect.link_down_threshold or more within the window",
    "the link went down or retrained (a flapping cable, transceiver or switch port): check the switch's port "
    "log and `dmesg | grep mlx5`, replace the cable or transceiver; it clears when the window passes quietly",
)
HCA_PORT_ERRORS = Reason(
    "HcaPortErrors",
    Status.WARN,
    "symbol, receive, link-integrity or buffer-overrun errors rose by interconnect.error_threshold or more "
    "within the window",
    "bit errors on the link (signal integrity): clean or replace the cable or transceiver, check "
    "`perfquery -x` on both ends; it clears when the window passes quietly",
)
INTERCONNECT_REASONS = (HCA_PORT_DOWN, HCA_PORT_MISSING, HCA_PORT_DEGRADED, HCA_PORT_FLAPPING, HCA_PORT_ERRORS)
