#!/bin/sh
# Stand-in for kubelet. It runs at the moment the real kubelet would start and
# records, before anything else can change it, what a kubelet would find:
# the stable device links, the sparsevol units and the loop devices.
d=/run/e2e-kubelet
mkdir -p "$d"
cat /proc/uptime > "$d/uptime"
find /dev/disk /dev/sparsevol -mindepth 1 -maxdepth 2 ! -type d -printf '%p %l\n' > "$d/disk-links" 2>/dev/null
systemctl list-units --all --plain --no-legend --no-pager 'sparsevol@*' > "$d/units" 2>&1
losetup --list --noheadings --raw --output NAME,BACK-FILE > "$d/loops" 2>&1
exit 0
