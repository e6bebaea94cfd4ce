package volume

import (
	"os"

	"github.com/sparsevol/sparsevol/internal/loop"
)

// Status is a volume's metadata joined with what the kernel says now.
type Status struct {
	Volume
	Attached bool `json:"attached"`
	// Device is the whole loop device (/dev/loopN); DataDevice is what to
	// format, mount or hand to a pod: the partition of a partitioned volume.
	Device           string `json:"device"`
	DataDevice       string `json:"dataDevice"`
	StablePath       string `json:"stablePath"`
	StablePathExists bool   `json:"stablePathExists"`
	AllocatedBytes   int64  `json:"allocatedBytes"`
	// SharedBytes is the part of AllocatedBytes that other files (the
	// volume's snapshots, clones, its source) share: counted once in the
	// store's Space. Status and Statuses fill it.
	SharedBytes    int64    `json:"sharedBytes,omitempty"`
	FileSizeBytes  int64    `json:"fileSizeBytes"`
	FileMissing    bool     `json:"fileMissing,omitempty"`
	DirectIOActive bool     `json:"directIO"`
	MountPoints    []string `json:"mountPoints,omitempty"`
	// DataDeviceBytes is the size the kernel gives the data device.
	DataDeviceBytes int64    `json:"dataDeviceBytes,omitempty"`
	ExtraDevices    []string `json:"extraDevices,omitempty"`
	// ForeignDevices are loop devices someone else bound to the volume's
	// file (not ours by loop.Owner); Volume.Problem then says so.
	// Operations refuse such a volume.
	ForeignDevices []string `json:"foreignDevices,omitempty"`
}

// AllocatedRatio is allocated bytes over logical size.
func (st *Status) AllocatedRatio() float64 {
	if st.SizeBytes == 0 {
		return 0
	}
	return float64(st.AllocatedBytes) / float64(st.SizeBytes)
}

// Status reports one volume.
func (s *Store) Status(ref string) (*Status, error) {
	v, err := s.Get(ref)
	if err != nil {
		return nil, err
	}
	st := s.statusOf(v)
	st.SharedBytes = s.sharedBytes(v.UUID)
	return st, nil
}

// Statuses reports every volume, scanning loop devices once.
func (s *Store) Statuses() ([]*Status, error) {
	vols, err := s.List()
	if err != nil {
		return nil, err
	}
	var ids []loop.FileID
	idsOf := make([][]loop.FileID, len(vols))
	presentOf := make([]loop.FileID, len(vols))
	for i, v := range vols {
		idsOf[i], presentOf[i] = s.backingIDs(v)
		ids = append(ids, idsOf[i]...)
	}
	bound, err := loop.Bound(ids...)
	if err != nil {
		return nil, err
	}
	mounts := loop.ReadMountTable() // once, not per volume
	out := make([]*Status, 0, len(vols))
	// Only where something can share extents: FIEMAP of every backing
	// file would cost a store of many volumes for nothing.
	sharing := anyCopied(vols)
	if !sharing {
		uuids, _ := s.snapshotUUIDs()
		sharing = len(uuids) > 0
	}
	for i, v := range vols {
		st := s.statusFound(v, idsOf[i], presentOf[i], bound, mounts)
		if sharing {
			st.SharedBytes = s.sharedBytes(v.UUID)
		}
		out = append(out, st)
	}
	return out, nil
}

// statusOf reports v with its devices. Where ownDevices settles them it
// costs the same whatever the number of bound devices; otherwise it looks
// at every bound device (loop.Bound).
func (s *Store) statusOf(v *Volume) *Status {
	ids, present := s.backingIDs(v)
	if ours, ok := s.ownDevices(v, ids, present); ok {
		return s.statusFound(v, ids, present, map[loop.FileID][]*loop.Device{present: ours}, nil)
	}
	bound, _ := loop.Bound(ids...)
	return s.statusFound(v, ids, present, bound, nil)
}

// ownDevices finds v's devices without a look at every bound device, where
// that settles it (ok): the device v's link names, proven v's (what attach
// last published for v), or none at all when v's backing file is open
// nowhere else (unboundFile). ids and present are backingIDs(v); a file
// gone, replaced under a device (two identities) or one that cannot be
// opened is left to the scan. Devices someone else bound beside v's own
// are refused when v's device is bound and by detach and delete, and
// reported by Statuses (list, doctor), which scan once for all; they are
// not looked for here.
func (s *Store) ownDevices(v *Volume, ids []loop.FileID, present loop.FileID) (ours []*loop.Device, ok bool) {
	if len(ids) != 1 || ids[0] != present {
		return nil, false
	}
	if d := linkedDevice(v.UUID); d != nil && d.Backing == ids[0] && v.owner(d.Backing).Check(d) == nil {
		return []*loop.Device{d}, true
	}
	return nil, s.unboundFile(v, ids)
}

// statusFound is status for devices found by loop.Bound: v's own, and the
// foreign ones named as a problem.
func (s *Store) statusFound(v *Volume, ids []loop.FileID, present loop.FileID, bound map[loop.FileID][]*loop.Device, mounts loop.MountTable) *Status {
	ours, foreign := s.devicesOf(v, ids, present, bound)
	st := s.status(v, ours, mounts)
	for _, d := range foreign {
		st.ForeignDevices = append(st.ForeignDevices, d.Path)
	}
	if len(foreign) > 0 && st.Problem == "" {
		st.Problem = s.foreignError("use", v, present, foreign).Error()
	}
	if st.State == StateReady && st.FileMissing && st.Attached {
		st.State = StateOrphaned
		st.Problem = s.orphaned(v, ours).Error()
	}
	if st.State == StateReady && v.ExpandingTo != 0 {
		st.State = StateExpanding
	}
	return st
}

// status joins v with its devices; mounts may be nil (read here) or a
// table the caller read once for many volumes (empty: MountPoints is
// left out).
func (s *Store) status(v *Volume, devs []*loop.Device, mounts loop.MountTable) *Status {
	st := &Status{Volume: *v, StablePath: v.StablePath()}
	fst, err := s.statBacking(v.UUID)
	switch {
	case isNotExist(err):
		st.FileMissing = true
	case err != nil:
		st.Problem = err.Error()
	default:
		st.FileSizeBytes = fst.Size
		st.AllocatedBytes = fst.Blocks * 512
	}
	if len(devs) > 0 {
		dev := devs[0]
		st.Attached = true
		st.Device = dev.Path
		st.DirectIOActive = dev.DirectIO()
		st.DataDevice, _ = dataDevice(v, dev)
		for _, extra := range devs[1:] {
			st.ExtraDevices = append(st.ExtraDevices, extra.Path)
		}
		if st.DataDevice != "" {
			if mounts == nil {
				mounts = loop.ReadMountTable()
			}
			st.MountPoints, _ = mounts.Of(st.DataDevice)
			if st.DataDevice == dev.Path && dev.Bytes > 0 {
				st.DataDeviceBytes = int64(dev.Bytes) // asked at bind time
			} else if size, err := loop.Size(st.DataDevice); err == nil {
				st.DataDeviceBytes = int64(size)
			}
		}
	}
	if _, err := os.Stat(st.StablePath); err == nil {
		st.StablePathExists = true
	}
	return st
}
