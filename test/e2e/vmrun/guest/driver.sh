#!/bin/bash
# Guest side of the VM harness. Started once per boot by e2e-driver.service
# (after multi-user.target), it runs the steps the host wrote to
# /e2e/boot/steps ("NAME LIMIT" lines), one process per step, each with its
# own log, exit code, duration and facts under /e2e/out/<boot>/, saves the
# journals of the units in /e2e/boot/journals, then does what
# /e2e/boot/next says: reboot, poweroff, or "kill": report ready and wait
# for the host to kill the VM.
set -u
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
E2E=/e2e
BOOT=$(cat "$E2E/boot/name")
OUT=$E2E/out/$BOOT
mkdir -p "$OUT"
say() { echo "e2e[$BOOT]: $*"; }
cat /proc/uptime >"$OUT/driver-start-uptime"

while read -r step limit; do
	[ -n "$step" ] || continue
	say "step $step"
	t0=$(date +%s%N)
	timeout --kill-after=10 "${limit:-600}" bash "$E2E/lib/step.sh" "$step" "$OUT" \
		>"$OUT/$step.log" 2>&1
	rc=$?
	t1=$(date +%s%N)
	echo "$rc" >"$OUT/$step.rc"
	echo "$(((t1 - t0) / 1000000))" >"$OUT/$step.ms"
	say "step $step: exit $rc in $(((t1 - t0) / 1000000)) ms"
	grep -h '^fail=' "$OUT/$step.facts" 2>/dev/null | sed "s/^/e2e[$BOOT] $step: /"
	[ "$rc" = 0 ] || tail -n 20 "$OUT/$step.log" | sed "s/^/e2e[$BOOT] $step: /"
done <"$E2E/boot/steps"

next=$(cat "$E2E/boot/next")
if [ "$next" = kill ]; then
	# The reset comes right after the last step: no sync beyond what the
	# steps fsynced themselves, so it finds exactly what a crash would.
	echo "$next" >"$OUT/done"
	say "ready to be killed"
	echo ready >"$OUT/kill-me"
	sleep infinity
fi
mkdir -p "$OUT/journal"
while read -r u; do
	[ -n "$u" ] || continue
	journalctl -b --no-pager -o short-monotonic -u "$u" >"$OUT/journal/${u//\*/all}.log" 2>&1
done <"$E2E/boot/journals"
journalctl -b -o short-monotonic --no-pager >"$OUT/journal-end.txt" 2>&1
systemd-analyze blame >"$OUT/blame.txt" 2>&1
sync
echo "$next" >"$OUT/done"
case "$next" in
reboot)
	say "rebooting"
	systemctl --no-block reboot
	;;
*)
	say "powering off"
	systemctl --no-block poweroff
	;;
esac
