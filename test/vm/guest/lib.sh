# The volume helpers test/vm's steps share (sourced after the shared library,
# test/e2e/vmrun/guest/lib.sh, whose fact, fail, die and run they use).
MNT=/mnt/e2e
mkdir -p "$STATE/vols" "$MNT"

# Per-volume state kept on the host share, so it survives hard resets.
vset() { echo "$2=$3" >>"$STATE/vols/$1"; }
vget() { sed -n "s|^$2=||p" "$STATE/vols/$1" 2>/dev/null | tail -n 1; }
vols_of() { ls "$STATE/vols" 2>/dev/null | grep "^$1-" || true; }

# sv NAME ARGS...: run sparsevol with the --root the volume was created with.
sv() {
	local name=$1 root
	shift
	root=$(vget "$name" root)
	if [ -n "$root" ]; then
		run sparsevol --root "$root" "$@"
	else
		run sparsevol "$@"
	fi
}

# The path Kubernetes would be given for a volume of this kind.
link_of() {
	case $(vget "$1" kind) in
	ext4 | xfs) echo "/dev/disk/by-uuid/$(vget "$1" uuid)" ;;
	block) echo "/dev/disk/by-partuuid/$(vget "$1" uuid)" ;;
	*) echo "" ;;
	esac
}

# create_vol NAME KIND SIZE [ROOT]; KIND is ext4, xfs, block (GPT partition)
# or raw (whole device, --no-partition).
create_vol() {
	local name=$1 kind=$2 size=$3 root=${4:-} out uuid
	local args=()
	[ -n "$root" ] && args+=(--root "$root")
	args+=(create "$name" --size "$size")
	case $kind in
	ext4 | xfs) args+=(--fs "$kind") ;;
	block) args+=(--mode block) ;;
	raw) args+=(--mode block --no-partition) ;;
	esac
	: >"$STATE/vols/$name"
	vset "$name" kind "$kind"
	vset "$name" root "$root"
	fact "$name.kind" "$kind"
	if ! out=$(run sparsevol "${args[@]}"); then
		fact "$name.create" failed
		fail "create $name failed"
		return 1
	fi
	uuid=$(printf '%s\n' "$out" | tail -n 1 | tr -d '[:space:]')
	vset "$name" uuid "$uuid"
	fact "$name.uuid" "$uuid"
	fact "$name.create" ok
}

# status_facts NAME PREFIX: what `sparsevol status -o json` says now.
status_facts() {
	local name=$1 p=$2 uuid j
	uuid=$(vget "$name" uuid)
	if ! j=$(sv "$name" status "$uuid" -o json); then
		fact "$p.status" error
		return 1
	fi
	fact "$p.status" ok
	fact "$p.attached" "$(jq -r '.attached' <<<"$j")"
	fact "$p.device" "$(jq -r '.device // ""' <<<"$j")"
	fact "$p.stablePath" "$(jq -r '.stablePath // ""' <<<"$j")"
	fact "$p.backingFile" "$(jq -r '.backingFile // ""' <<<"$j")"
	vset "$name" backing "$(jq -r '.backingFile // ""' <<<"$j")"
	vset "$name" device "$(jq -r '.device // ""' <<<"$j")"
	vset "$name" stable "$(jq -r '.stablePath // ""' <<<"$j")"
}

# fs_facts NAME DEVICE: identity of the filesystem on DEVICE.
fs_facts() {
	local name=$1 dev=$2
	fact "$name.fsUUID" "$(blkid -p -o value -s UUID "$dev")"
	case $(vget "$name" kind) in
	ext4) fact "$name.fsIdentity" "$(tune2fs -l "$dev" | sed -n 's/^Filesystem created: *//p')" ;;
	xfs) fact "$name.fsIdentity" "$(xfs_db -r -c 'sb 0' -c 'p uuid' "$dev" | sed 's/^uuid = //')" ;;
	esac
}

# write_data NAME [keep]: writes 4 MiB of random data through the volume's
# device, fsyncs it and records its sha256. Filesystems get a file "data"
# (left mounted with "keep", as a node with running pods would be); block
# volumes get the data at offset 1 MiB of the partition or whole device.
write_data() {
	local name=$1 keep=${2:-} kind dev link target sha
	kind=$(vget "$name" kind)
	status_facts "$name" "$name" || {
		fail "status $name"
		return 1
	}
	dev=$(vget "$name" device)
	link=$(link_of "$name")
	[ -n "$link" ] && fact "$name.linkAtCreate" "$(yesno test -e "$link")"
	fact "$name.stableAtCreate" "$(yesno test -e "$(vget "$name" stable)")"
	head -c 4M /dev/urandom >/tmp/e2e-data
	sha=$(sha256sum </tmp/e2e-data | cut -d' ' -f1)
	case $kind in
	ext4 | xfs)
		mkdir -p "$MNT/$name"
		run mount "$dev" "$MNT/$name" || {
			fail "mount $name"
			return 1
		}
		run dd if=/tmp/e2e-data of="$MNT/$name/data" bs=1M conv=fsync status=none || fail "write $name"
		fs_facts "$name" "$dev"
		[ "$keep" = keep ] || run umount "$MNT/$name"
		;;
	block | raw)
		if [ "$kind" = block ]; then target=$(readlink -f "$link"); else target=$dev; fi
		[ -b "$target" ] || {
			fail "no block device for $name ($target)"
			return 1
		}
		fact "$name.dataDevice" "$target"
		run dd if=/tmp/e2e-data of="$target" bs=1M seek=1 conv=fsync oflag=direct status=none || fail "write $name"
		;;
	esac
	fact "$name.sha" "$sha"
}

# check_vol NAME: after a reboot, everything about the volume the host compares
# with what write_data recorded.
check_vol() {
	local name=$1 kind uuid link dev target sha=""
	kind=$(vget "$name" kind)
	uuid=$(vget "$name" uuid)
	link=$(link_of "$name")
	fact "$name.uuid" "$uuid"
	fact "$name.unit" "$(systemctl is-active "sparsevol@$uuid.service")"
	fact "$name.enabled" "$(systemctl is-enabled "sparsevol@$uuid.service" 2>&1)"
	[ -n "$link" ] && fact "$name.linkNow" "$(yesno test -e "$link")"
	status_facts "$name" "$name" || return 1
	dev=$(vget "$name" device)
	case $kind in
	ext4 | xfs)
		mkdir -p "$MNT/$name"
		if run mount "$dev" "$MNT/$name"; then
			sha=$(sha256sum <"$MNT/$name/data" | cut -d' ' -f1)
			run umount "$MNT/$name"
		fi
		fs_facts "$name" "$dev"
		;;
	block | raw)
		if [ "$kind" = block ]; then target=$(readlink -f "$link"); else target=$dev; fi
		fact "$name.dataDevice" "$target"
		[ -b "$target" ] && sha=$(dd if="$target" bs=1M skip=1 count=4 iflag=direct status=none | sha256sum | cut -d' ' -f1)
		;;
	esac
	fact "$name.sha" "$sha"
}

# gone_facts NAME PREFIX: every trace a deleted volume could leave behind.
gone_facts() {
	local name=$1 p=$2 uuid backing
	uuid=$(vget "$name" uuid)
	backing=$(vget "$name" backing)
	fact "$p.unitActive" "$(systemctl is-active "sparsevol@$uuid.service")"
	fact "$p.unitEnabled" "$(systemctl is-enabled "sparsevol@$uuid.service" 2>&1)"
	fact "$p.unitLinks" "$(find /etc/systemd /run/systemd/system /usr/local/lib/systemd -name "sparsevol@$uuid.service*" 2>/dev/null | oneline)"
	fact "$p.fileExists" "$(yesno test -e "$backing")"
	fact "$p.storeFiles" "$(ls -a "$(dirname "$backing")" 2>/dev/null | grep -F "$uuid" | oneline)"
	fact "$p.loops" "$(losetup --list --noheadings --raw --output NAME,BACK-FILE | grep -F "$uuid" | oneline)"
	fact "$p.links" "$(find /dev/disk /dev/sparsevol -name "*$uuid*" 2>/dev/null | oneline)"
	fact "$p.listed" "$(sv "$name" list -o json | jq -r --arg u "$uuid" '[.[] | select(.uuid == $u)] | length')"
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

# check_set PREFIX: check_vol of each volume of the set.
check_set() {
	local n
	for n in $(vols_of "$1"); do check_vol "$n"; done
}
