# Step bodies (sourced by step.sh). The host lists, per boot, which steps run
# and in which order; see plan in e2e_test.go.

STORE=/srv/sparsevol-store
OLD_DIR=/var/lib/metalk8s/storage/sparse
HAND_DIR=/var/lib/by-hand

# collect runs first in every boot: what kubelet.service saw, unit states and
# timestamps, the journal.
step_collect() {
	if [ -d /run/e2e-kubelet ]; then
		cp -r /run/e2e-kubelet "$OUT/kubelet"
		fact kubelet.ran yes
	else
		fact kubelet.ran no
	fi
	read -r up _ </proc/uptime
	fact driver.uptime "$up"
	systemctl show -p UserspaceTimestampMonotonic -p InitRDTimestampMonotonic | sed 's/^/manager./' >>"$FACTS"
	systemctl show -p ActiveState -p ExecMainStartTimestampMonotonic kubelet.service | sed 's/^/kubelet./' >>"$FACTS"
	systemctl show -p ActiveState -p Result -p InactiveExitTimestampMonotonic -p ActiveEnterTimestampMonotonic \
		sparsevol-boot.service | sed 's/^/bootunit./' >>"$FACTS"
	systemctl show -p Id -p ActiveState -p SubState -p Result \
		-p InactiveExitTimestampMonotonic -p ActiveEnterTimestampMonotonic \
		-p After -p RequiresMountsFor 'sparsevol@*' >"$OUT/units.show"
	systemctl show -p Id -p ActiveState -p ActiveEnterTimestampMonotonic '*.mount' >"$OUT/mounts.show"
	journalctl -b -o json --no-pager -u 'sparsevol@*' >"$OUT/journal-units.json"
	journalctl -b -o short-monotonic --no-pager >"$OUT/journal.txt"
	fact uname "$(uname -r)"
}

# Scenario 1: a volume made by hand the old way, with no unit.
step_s1_setup() {
	local uuid f loop
	uuid=$(cat /proc/sys/kernel/random/uuid)
	f=$HAND_DIR/$uuid
	mkdir -p "$HAND_DIR"
	run truncate -s 64M "$f" || die "truncate"
	run mkfs.ext4 -q -U "$uuid" "$f" || die "mkfs.ext4"
	loop=$(run losetup --find --show "$f") || die "losetup"
	run udevadm settle
	fact s1.uuid "$uuid"
	fact s1.file "$f"
	fact s1.loop "$loop"
	fact s1.linkAtCreate "$(yesno test -e "/dev/disk/by-uuid/$uuid")"
	printf 'uuid=%s\nfile=%s\n' "$uuid" "$f" >"$STATE/s1"
	sync
}

step_s1_check() {
	local uuid f
	uuid=$(sed -n 's/^uuid=//p' "$STATE/s1")
	f=$(sed -n 's/^file=//p' "$STATE/s1")
	run udevadm settle
	fact s1.uuid "$uuid"
	fact s1.fileExists "$(yesno test -e "$f")"
	fact s1.linkNow "$(yesno test -e "/dev/disk/by-uuid/$uuid")"
	fact s1.loops "$(losetup --noheadings --output NAME -j "$f" | oneline)"
}

# make_set PREFIX ROOT [keep]: one volume of every kind, with data.
make_set() {
	local p=$1 root=$2 keep=${3:-} n
	create_vol "$p-ext4" ext4 64M "$root" && write_data "$p-ext4" "$keep"
	create_vol "$p-xfs" xfs 512M "$root" && write_data "$p-xfs" "$keep"
	create_vol "$p-block" block 64M "$root" && write_data "$p-block"
	create_vol "$p-raw" raw 64M "$root" && write_data "$p-raw"
	for n in $(vols_of "$p"); do fact "$n.uuid" "$(vget "$n" uuid)"; done
}

check_set() {
	local n
	for n in $(vols_of "$1"); do check_vol "$n"; done
}

# Scenario 2: clean reboot. Filesystems stay mounted over the reboot, as a
# node's pod volumes would be.
step_s2_setup() {
	make_set s2 "" keep
}
step_s2_check() { check_set s2; }

# Scenario 3: hard reset right after the data is fsynced (the host kills the
# VM once the driver reports this step done).
step_s3_setup() {
	make_set s3 "" keep
}
step_s3_check() { check_set s3; }

# Scenario 4: the store on its own disk (/dev/vdb), mounted from /etc/fstab.
step_s4_setup() {
	run mkfs.ext4 -q -F -L e2e-store /dev/vdb || die "mkfs store"
	echo "LABEL=e2e-store $STORE ext4 defaults 0 2" >>/etc/fstab
	mkdir -p "$STORE"
	run systemctl daemon-reload
	run mount "$STORE" || die "mount store"
	create_vol s4-ext4 ext4 64M "$STORE" && write_data s4-ext4
	create_vol s4-block block 64M "$STORE" && write_data s4-block
	sync
}
step_s4_check() {
	fact s4.storeMounted "$(findmnt -n -o SOURCE "$STORE" | oneline)"
	check_set s4
}

# Scenario 5: stop and delete the volumes of scenario 2 after their reboot
# (s2-check has run before in the same boot), then one more reboot.
step_s5_stop_delete() {
	local n uuid link
	# The units came up in boot mode (no process of their own); once the
	# boot is over a restart must run their own detach and attach again.
	run systemctl start sparsevol-boot-done.service
	fact s5.bootDone "$(yesno test -e /run/sparsevol/boot-done)"
	for n in $(vols_of s2); do
		uuid=$(vget "$n" uuid)
		link=$(link_of "$n")
		run systemctl restart "sparsevol@$uuid.service"
		fact "$n.restartExit" "$?"
		fact "$n.afterRestart.loops" "$(losetup --list --noheadings --raw --output NAME,BACK-FILE | grep -F "$uuid" | oneline)"
		[ -n "$link" ] && fact "$n.afterRestart.link" "$(yesno test -e "$link")"
		run systemctl stop "sparsevol@$uuid.service"
		fact "$n.stopExit" "$?"
		run udevadm settle
		fact "$n.afterStop.unitActive" "$(systemctl is-active "sparsevol@$uuid.service")"
		fact "$n.afterStop.loops" "$(losetup --list --noheadings --raw --output NAME,BACK-FILE | grep -F "$uuid" | oneline)"
		[ -n "$link" ] && fact "$n.afterStop.link" "$(yesno test -e "$link")"
		status_facts "$n" "$n.afterStop"
		sv "$n" delete "$uuid"
		fact "$n.deleteExit" "$?"
		run udevadm settle
		gone_facts "$n" "$n.afterDelete"
	done
}
step_s5_check_gone() {
	local n
	run udevadm settle
	for n in $(vols_of s2); do gone_facts "$n" "$n.afterReboot"; done
}

# Scenario 6: an old install's sparse files, adopted in place: their
# directory becomes a store (--root), so nothing moves.
step_s6_setup() {
	local u1 u2 f loop sha
	mkdir -p "$OLD_DIR" "$MNT/old"
	u1=$(cat /proc/sys/kernel/random/uuid)
	u2=$(cat /proc/sys/kernel/random/uuid)
	head -c 4M /dev/urandom >/tmp/e2e-data
	sha=$(sha256sum </tmp/e2e-data | cut -d' ' -f1)

	# Formatted volume, written through a temporary loop mount.
	f=$OLD_DIR/$u1
	run truncate -s 64M "$f" && run mkfs.ext4 -q -U "$u1" "$f" || die "old ext4"
	run mount -o loop "$f" "$MNT/old" || die "mount old ext4"
	run dd if=/tmp/e2e-data of="$MNT/old/data" bs=1M conv=fsync status=none || die "write old ext4"
	run umount "$MNT/old"
	: >"$STATE/vols/s6-ext4"
	vset s6-ext4 kind ext4
	vset s6-ext4 uuid "$u1"
	vset s6-ext4 root "$OLD_DIR"
	fact s6-ext4.kind ext4
	fact s6-ext4.uuid "$u1"
	fact s6-ext4.sha "$sha"
	fact s6-ext4.fileBefore "$(sha256sum <"$f" | cut -d' ' -f1)"
	fs_facts s6-ext4 "$f"

	# Raw block volume: a GPT partition whose GUID is the volume UUID.
	f=$OLD_DIR/$u2
	run truncate -s 64M "$f" || die "truncate"
	run sgdisk --largest-new 1 --partition-guid "1:$u2" "$f" || die "sgdisk"
	loop=$(run losetup --find --show --partscan "$f") || die "losetup"
	run udevadm settle
	run dd if=/tmp/e2e-data of="${loop}p1" bs=1M seek=1 conv=fsync oflag=direct status=none || die "write old block"
	run losetup -d "$loop"
	run udevadm settle
	: >"$STATE/vols/s6-block"
	vset s6-block kind block
	vset s6-block uuid "$u2"
	vset s6-block root "$OLD_DIR"
	fact s6-block.kind block
	fact s6-block.uuid "$u2"
	fact s6-block.sha "$sha"
	fact s6-block.fileBefore "$(sha256sum <"$f" | cut -d' ' -f1)"

	run sparsevol --root "$OLD_DIR" adopt --dir "$OLD_DIR"
	fact s6.adoptExit "$?"
	run udevadm settle
	for n in s6-ext4 s6-block; do
		status_facts "$n" "$n.afterAdopt"
		fact "$n.afterAdopt.enabled" "$(systemctl is-enabled "sparsevol@$(vget "$n" uuid).service" 2>&1)"
	done
	sync
	[ "$(cat "$FACTS" | sed -n 's/^s6.adoptExit=//p')" = 0 ] || return 1
}
step_s6_check() {
	local n
	for n in s6-ext4 s6-block; do
		fact "$n.fileAfterReboot" "$(sha256sum <"$OLD_DIR/$(vget "$n" uuid)" | cut -d' ' -f1)"
		check_vol "$n"
	done
}

# Scenario 7, first half: remove every other volume and the store's fstab
# entry, so that the next boot differs from the baseline boot only by the
# scale set.
step_s7_clear() {
	local root u
	for root in "" "$STORE" "$OLD_DIR"; do
		[ -z "$root" ] || mountpoint -q "$root" || [ -d "$root/.locks" ] || continue
		# Four at a time: each delete waits for two systemd reloads.
		sparsevol ${root:+--root "$root"} list -o json | jq -r '.[].uuid' |
			xargs -r -P 4 -n 1 sparsevol ${root:+--root "$root"} delete || fail "delete in ${root:-default store}"
	done
	if grep -q e2e-store /etc/fstab; then
		run umount "$STORE"
		sed -i '/e2e-store/d' /etc/fstab
		run systemctl daemon-reload
	fi
	fact s7.left "$(sparsevol list -o json | jq length)"
	sync
}

# Scenario 7, second half, when the host asks for it (SPARSEVOL_E2E_SCALE_IN_GUEST):
# create the scale set here with `sparsevol create`. By default the host
# creates it offline, which is much faster under software emulation.
step_s7_create() {
	local i n t0 t1 names=""
	t0=$(date +%s%N)
	for i in $(seq -w 1 "${S7_COUNT:-100}"); do
		n=s7-$i
		create_vol "$n" ext4 "${S7_SIZE:-16M}"
		names="$names $n"
	done
	t1=$(date +%s%N)
	fact s7.createMs "$(( (t1 - t0) / 1000000 ))"
	fact s7.volumes "${names# }"
	sync
}

step_s7_check() {
	sparsevol list -o json >"$OUT/s7-list.json"
	fact s7.listed "$(jq '[.[] | select(.name | startswith("s7-"))] | length' "$OUT/s7-list.json")"
	fact s7.attached "$(jq '[.[] | select((.name | startswith("s7-")) and .attached)] | length' "$OUT/s7-list.json")"
}

# baseline: nothing beyond collect; the host reads this boot's timestamps.
step_baseline() { :; }
