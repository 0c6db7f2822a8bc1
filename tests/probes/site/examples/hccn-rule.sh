#!/bin/sh
# A site check (docs/probes/site.md): every NPU of the node has its RoCE address in hccn.conf (fail without),
# and a netdetect address the NPU's link is probed against (warn without).
# Usage: hccn-rule.sh [HCCN_CONF [NPUS]], default /etc/hccn.conf and 8 NPUs.
conf=${1:-/etc/hccn.conf}
count=${2:-8}
if [ ! -r "$conf" ]; then
    echo "$conf is missing"
    exit 2
fi
missing=""
undetected=""
i=0
while [ "$i" -lt "$count" ]; do
    grep -q "^address_$i=" "$conf" || missing="$missing $i"
    grep -q "^netdetect_$i=" "$conf" || undetected="$undetected $i"
    i=$((i + 1))
done
if [ -n "$missing" ]; then
    echo "no address_N in $conf for NPU$missing"
    exit 2
fi
if [ -n "$undetected" ]; then
    echo "no netdetect_N in $conf for NPU$undetected"
    exit 1
fi
echo "$count NPUs with an address and a netdetect address in $conf"
exit 0
