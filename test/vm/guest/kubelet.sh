#!/bin/sh
# Stand-in for kubelet. It runs at the moment the real kubelet would start and
# records, before anything else can change it, what a kubelet would find:
# the stable device links, the sparsevol units and the loop devices.
d=/run/e2e-kubelet
mkdir -p "$d"
cat /proc/uptime > "$d/uptime"
# Where the CPU went until now (the scale scenario compares it with a boot
# without volumes): all CPUs' busy and idle time, and systemd's, udev's,
# journald's and sparsevol's share.
head -n 1 /proc/stat > "$d/cpu"
systemctl show -p Id -p CPUUsageNSec init.scope systemd-udevd.service systemd-journald.service sparsevol-boot.service >> "$d/cpu" 2>&1
find /dev/disk /dev/sparsevol -mindepth 1 -maxdepth 2 ! -type d -printf '%p %l\n' > "$d/disk-links" 2>/dev/null
systemctl list-units --all --plain --no-legend --no-pager 'sparsevol@*' > "$d/units" 2>&1
losetup --list --noheadings --raw --output NAME,BACK-FILE > "$d/loops" 2>&1
exit 0
