#!/bin/sh
# A site check (docs/probes/site.md): the driver version this site pins.
# Usage: driver-pin.sh VERSION_FILE PINNED, e.g. driver-pin.sh /sys/module/nvidia/version 550.54.15
# Exit 0 when the loaded driver is the pinned one, 2 when it is another or none is loaded.
file=$1
pinned=$2
if [ ! -r "$file" ]; then
    echo "no driver loaded: $file is missing (pinned $pinned)"
    exit 2
fi
loaded=$(head -n 1 "$file" | tr -d '[:space:]')
if [ "$loaded" = "$pinned" ]; then
    echo "driver $loaded, as pinned"
    exit 0
fi
echo "driver $loaded loaded, this site pins $pinned"
exit 2
