#!/bin/bash
# Guest side of the k8s end-to-end test. Started once per boot by
# e2e-k8s-driver.service, it runs the steps the host wrote to
# /e2e/boot/steps, one process per step, each with its own log, exit code
# and facts under /e2e/out/<boot>/, collects the journals of the node's
# services, then does what /e2e/boot/next says: reboot or poweroff.
set -u
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
E2E=/e2e
BOOT=$(cat "$E2E/boot/name")
OUT=$E2E/out/$BOOT
mkdir -p "$OUT"
say() { echo "e2e-k8s[$BOOT]: $*"; }
cat /proc/uptime >"$OUT/driver-start-uptime"

while read -r step limit; do
	[ -n "$step" ] || continue
	say "step $step"
	t0=$(date +%s%N)
	timeout --kill-after=10 "${limit:-600}" bash "$E2E/guest/step.sh" "$step" "$OUT" \
		>"$OUT/$step.log" 2>&1
	rc=$?
	t1=$(date +%s%N)
	echo "$rc" >"$OUT/$step.rc"
	echo "$(((t1 - t0) / 1000000))" >"$OUT/$step.ms"
	say "step $step: exit $rc in $(((t1 - t0) / 1000000)) ms"
	[ "$rc" = 0 ] || tail -n 15 "$OUT/$step.log" | sed "s/^/e2e-k8s[$BOOT] $step: /"
done <"$E2E/boot/steps"

mkdir -p "$OUT/journal"
for u in sparsevol-csi csi-provisioner kubelet containerd kube-apiserver kube-controller-manager kube-scheduler etcd k8s-images k8s-net; do
	journalctl -b --no-pager -o short-monotonic -u "$u" >"$OUT/journal/$u.log" 2>&1
done
journalctl -b --no-pager -o short-monotonic -u 'sparsevol@*' >"$OUT/journal/sparsevol-units.log" 2>&1
systemd-analyze blame >"$OUT/journal/blame.txt" 2>&1
free -m >"$OUT/journal/free.txt" 2>&1

next=$(cat "$E2E/boot/next")
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
