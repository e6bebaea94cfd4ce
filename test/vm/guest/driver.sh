#!/bin/bash
# Guest side of the sparsevol VM test. Started once per boot by
# e2e-driver.service (after kubelet.service), it runs the steps the host wrote
# to /e2e/boot/steps, one process per step, each with its own log, exit code
# and facts file under /e2e/out/<boot>/, then does what /e2e/boot/next says:
# reboot, poweroff, or "kill": report ready and wait for the host to kill the VM.
set -u
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
E2E=/e2e
BOOT=$(cat "$E2E/boot/name")
OUT=$E2E/out/$BOOT
mkdir -p "$OUT"
say() { echo "e2e[$BOOT]: $*"; }

while read -r step limit; do
	[ -n "$step" ] || continue
	say "step $step"
	t0=$(date +%s%N)
	timeout --kill-after=10 "${limit:-600}" bash "$E2E/guest/step.sh" "$step" "$OUT" \
		>"$OUT/$step.log" 2>&1
	rc=$?
	t1=$(date +%s%N)
	echo "$rc" >"$OUT/$step.rc"
	echo "$(( (t1 - t0) / 1000000 ))" >"$OUT/$step.ms"
	say "step $step: exit $rc in $(( (t1 - t0) / 1000000 )) ms"
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
journalctl -b -o short-monotonic --no-pager >"$OUT/journal-end.txt" 2>&1
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
