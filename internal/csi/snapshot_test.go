package csi

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/sparsevol/sparsevol/internal/volume"
)

// storeState is what a refused request must leave as it was: every volume
// and snapshot of the store with its state.
func storeState(t testing.TB, e *testEnv) string {
	t.Helper()
	vols, err := e.store.List()
	if err != nil {
		t.Fatal(err)
	}
	sns, err := e.store.ListSnapshots(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var lines []string
	for _, v := range vols {
		lines = append(lines, fmt.Sprintf("volume %s %s %s %d", v.UUID, v.Name, v.State, v.SizeBytes))
	}
	for _, s := range sns {
		lines = append(lines, fmt.Sprintf("snapshot %s %s %s %s", s.UUID, s.Name, s.State, s.Group))
	}
	slices.Sort(lines)
	return strings.Join(lines, "\n")
}

func snapSource(id string) *csi.VolumeContentSource {
	return &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: id}}}
}

func volSource(id string) *csi.VolumeContentSource {
	return &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: id}}}
}

// TestSnapshotRequestsRefused sends hostile snapshot, group snapshot and
// content source requests: each is refused with its code (or, for deletes
// of what is not the driver's, succeeds doing nothing), and the store is
// unchanged. An operator's volume and CLI snapshot are never the CO's.
func TestSnapshotRequestsRefused(t *testing.T) {
	e := newTestEnv(t)
	ctx := context.Background()
	fs := rwCap(volume.ModeFilesystem, "ext4")
	vol := e.createVolume(t, "csi-vol", 16*mib, fs, nil)
	vol2 := e.createVolume(t, "csi-vol-2", 16*mib, fs, nil)
	own, err := e.store.Create(ctx, volume.CreateRequest{Name: "operators", SizeBytes: 16 * mib})
	if err != nil {
		t.Fatal(err)
	}
	cliSnap, err := e.store.CreateSnapshot(ctx, vol.VolumeId, "cli-snap", volume.SnapshotOptions{})
	if err != nil {
		t.Fatal(err)
	}
	snap, err := e.ctrl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "csi-snap", SourceVolumeId: vol.VolumeId})
	if err != nil {
		t.Fatal(err)
	}
	other := volume.NewUUID()
	otherNode := &csi.TopologyRequirement{Requisite: []*csi.Topology{{Segments: map[string]string{TopologyKey: "elsewhere"}}}}
	newVol := func(name string, c *csi.VolumeCapability, cr *csi.CapacityRange, src *csi.VolumeContentSource) *csi.CreateVolumeRequest {
		return &csi.CreateVolumeRequest{Name: name, VolumeCapabilities: []*csi.VolumeCapability{c}, CapacityRange: cr, VolumeContentSource: src}
	}
	group := func(name string, ids ...string) *csi.CreateVolumeGroupSnapshotRequest {
		return &csi.CreateVolumeGroupSnapshotRequest{Name: name, SourceVolumeIds: ids}
	}

	tests := []struct {
		name string
		call func() error
		code codes.Code
	}{
		// CreateSnapshot
		{"snapshot without name", func() error {
			_, err := e.ctrl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{SourceVolumeId: vol.VolumeId})
			return err
		}, codes.InvalidArgument},
		{"snapshot name with a slash", func() error {
			_, err := e.ctrl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "../x", SourceVolumeId: vol.VolumeId})
			return err
		}, codes.InvalidArgument},
		{"snapshot name shaped like a UUID", func() error {
			_, err := e.ctrl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: other, SourceVolumeId: vol.VolumeId})
			return err
		}, codes.InvalidArgument},
		{"snapshot name too long", func() error {
			_, err := e.ctrl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: strings.Repeat("a", 300), SourceVolumeId: vol.VolumeId})
			return err
		}, codes.InvalidArgument},
		{"snapshot without source", func() error {
			_, err := e.ctrl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "s"})
			return err
		}, codes.InvalidArgument},
		{"snapshot with a parameter", func() error {
			_, err := e.ctrl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "s", SourceVolumeId: vol.VolumeId, Parameters: map[string]string{"fast": "yes"}})
			return err
		}, codes.InvalidArgument},
		{"snapshot of a path", func() error {
			_, err := e.ctrl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "s", SourceVolumeId: "../../etc"})
			return err
		}, codes.NotFound},
		{"snapshot of a volume by name", func() error {
			_, err := e.ctrl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "s", SourceVolumeId: "csi-vol"})
			return err
		}, codes.NotFound},
		{"snapshot of an unknown volume", func() error {
			_, err := e.ctrl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "s", SourceVolumeId: other})
			return err
		}, codes.NotFound},
		{"snapshot of a snapshot", func() error {
			_, err := e.ctrl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "s", SourceVolumeId: snap.Snapshot.SnapshotId})
			return err
		}, codes.NotFound},
		{"snapshot of the operator's volume", func() error {
			_, err := e.ctrl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "s", SourceVolumeId: own.UUID})
			return err
		}, codes.FailedPrecondition},
		{"snapshot on another node", func() error {
			_, err := e.ctrl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "s", SourceVolumeId: vol.VolumeId, AccessibilityRequirements: otherNode})
			return err
		}, codes.ResourceExhausted},
		{"snapshot named like the operator's", func() error {
			_, err := e.ctrl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "cli-snap", SourceVolumeId: vol.VolumeId})
			return err
		}, codes.AlreadyExists},
		{"snapshot name taken by another source", func() error {
			_, err := e.ctrl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "csi-snap", SourceVolumeId: vol2.VolumeId})
			return err
		}, codes.AlreadyExists},

		// DeleteSnapshot, GetSnapshot, ListSnapshots
		{"delete without id", func() error {
			_, err := e.ctrl.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{})
			return err
		}, codes.InvalidArgument},
		{"delete a path", func() error {
			_, err := e.ctrl.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: "../" + snap.Snapshot.SnapshotId})
			return err
		}, codes.OK},
		{"delete the operator's snapshot", func() error {
			_, err := e.ctrl.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: cliSnap.UUID})
			return err
		}, codes.OK},
		{"delete a snapshot by name", func() error {
			_, err := e.ctrl.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: "csi-snap"})
			return err
		}, codes.OK},
		{"delete a volume as a snapshot", func() error {
			_, err := e.ctrl.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: vol.VolumeId})
			return err
		}, codes.OK},
		{"get without id", func() error {
			_, err := e.ctrl.GetSnapshot(ctx, &csi.GetSnapshotRequest{})
			return err
		}, codes.InvalidArgument},
		{"get the operator's snapshot", func() error {
			_, err := e.ctrl.GetSnapshot(ctx, &csi.GetSnapshotRequest{SnapshotId: cliSnap.UUID})
			return err
		}, codes.NotFound},
		{"get a volume as a snapshot", func() error {
			_, err := e.ctrl.GetSnapshot(ctx, &csi.GetSnapshotRequest{SnapshotId: vol.VolumeId})
			return err
		}, codes.NotFound},
		{"list with negative max", func() error {
			_, err := e.ctrl.ListSnapshots(ctx, &csi.ListSnapshotsRequest{MaxEntries: -1})
			return err
		}, codes.InvalidArgument},
		{"list from a forged token", func() error {
			_, err := e.ctrl.ListSnapshots(ctx, &csi.ListSnapshotsRequest{StartingToken: "../x"})
			return err
		}, codes.Aborted},

		// CreateVolume from a content source
		{"restore from an empty snapshot id", func() error {
			_, err := e.ctrl.CreateVolume(ctx, newVol("r", fs, nil, snapSource("")))
			return err
		}, codes.InvalidArgument},
		{"restore from no kind of source", func() error {
			_, err := e.ctrl.CreateVolume(ctx, newVol("r", fs, nil, &csi.VolumeContentSource{}))
			return err
		}, codes.InvalidArgument},
		{"restore from a volume id as snapshot", func() error {
			_, err := e.ctrl.CreateVolume(ctx, newVol("r", fs, nil, snapSource(vol.VolumeId)))
			return err
		}, codes.NotFound},
		{"restore from the operator's snapshot", func() error {
			_, err := e.ctrl.CreateVolume(ctx, newVol("r", fs, nil, snapSource(cliSnap.UUID)))
			return err
		}, codes.NotFound},
		{"restore from a snapshot name", func() error {
			_, err := e.ctrl.CreateVolume(ctx, newVol("r", fs, nil, snapSource("csi-snap")))
			return err
		}, codes.NotFound},
		{"restore below the source's size", func() error {
			_, err := e.ctrl.CreateVolume(ctx, newVol("r", fs, &csi.CapacityRange{LimitBytes: 8 * mib}, snapSource(snap.Snapshot.SnapshotId)))
			return err
		}, codes.OutOfRange},
		{"restore into another filesystem", func() error {
			_, err := e.ctrl.CreateVolume(ctx, newVol("r", rwCap(volume.ModeFilesystem, "xfs"), &csi.CapacityRange{RequiredBytes: 512 * mib}, snapSource(snap.Snapshot.SnapshotId)))
			return err
		}, codes.InvalidArgument},
		{"restore a filesystem as a block volume", func() error {
			_, err := e.ctrl.CreateVolume(ctx, newVol("r", rwCap(volume.ModeBlock, ""), nil, snapSource(snap.Snapshot.SnapshotId)))
			return err
		}, codes.InvalidArgument},
		{"restore with mkfs options", func() error {
			req := newVol("r", fs, nil, snapSource(snap.Snapshot.SnapshotId))
			req.Parameters = map[string]string{ParamMkfsOptions: "-m 0"}
			_, err := e.ctrl.CreateVolume(ctx, req)
			return err
		}, codes.InvalidArgument},
		{"clone an unknown volume", func() error {
			_, err := e.ctrl.CreateVolume(ctx, newVol("r", fs, nil, volSource(other)))
			return err
		}, codes.NotFound},
		{"clone a snapshot id as volume", func() error {
			_, err := e.ctrl.CreateVolume(ctx, newVol("r", fs, nil, volSource(snap.Snapshot.SnapshotId)))
			return err
		}, codes.NotFound},
		{"clone the operator's volume", func() error {
			_, err := e.ctrl.CreateVolume(ctx, newVol("r", fs, nil, volSource(own.UUID)))
			return err
		}, codes.FailedPrecondition},
		{"name taken by a volume of another source", func() error {
			_, err := e.ctrl.CreateVolume(ctx, newVol("csi-vol", fs, nil, snapSource(snap.Snapshot.SnapshotId)))
			return err
		}, codes.AlreadyExists},

		// Group snapshots
		{"group without name", func() error {
			_, err := e.group.CreateVolumeGroupSnapshot(ctx, group("", vol.VolumeId))
			return err
		}, codes.InvalidArgument},
		{"group without volumes", func() error {
			_, err := e.group.CreateVolumeGroupSnapshot(ctx, group("g"))
			return err
		}, codes.InvalidArgument},
		{"group naming a volume twice", func() error {
			_, err := e.group.CreateVolumeGroupSnapshot(ctx, group("g", vol.VolumeId, vol.VolumeId))
			return err
		}, codes.InvalidArgument},
		{"group with an empty id", func() error {
			_, err := e.group.CreateVolumeGroupSnapshot(ctx, group("g", vol.VolumeId, ""))
			return err
		}, codes.InvalidArgument},
		{"group with a parameter", func() error {
			req := group("g", vol.VolumeId)
			req.Parameters = map[string]string{"x": "y"}
			_, err := e.group.CreateVolumeGroupSnapshot(ctx, req)
			return err
		}, codes.InvalidArgument},
		{"group with an unknown volume", func() error {
			_, err := e.group.CreateVolumeGroupSnapshot(ctx, group("g", vol.VolumeId, other))
			return err
		}, codes.NotFound},
		{"group with the operator's volume", func() error {
			_, err := e.group.CreateVolumeGroupSnapshot(ctx, group("g", vol.VolumeId, own.UUID))
			return err
		}, codes.FailedPrecondition},
		{"get group without id", func() error {
			_, err := e.group.GetVolumeGroupSnapshot(ctx, &csi.GetVolumeGroupSnapshotRequest{})
			return err
		}, codes.InvalidArgument},
		{"get group by a path", func() error {
			_, err := e.group.GetVolumeGroupSnapshot(ctx, &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: "../x"})
			return err
		}, codes.NotFound},
		{"delete group without id", func() error {
			_, err := e.group.DeleteVolumeGroupSnapshot(ctx, &csi.DeleteVolumeGroupSnapshotRequest{})
			return err
		}, codes.InvalidArgument},
		{"delete an unknown group", func() error {
			_, err := e.group.DeleteVolumeGroupSnapshot(ctx, &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: "no-such-group"})
			return err
		}, codes.OK},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			before := storeState(t, e)
			err := tc.call()
			if status.Code(err) != tc.code {
				t.Errorf("got %v, want code %s", err, tc.code)
			}
			if after := storeState(t, e); after != before {
				t.Errorf("the store changed:\nbefore:\n%s\nafter:\n%s", before, after)
			}
		})
	}
}

// TestSnapshotRestoreAndClone snapshots a published volume, changes it,
// and proves what each copy holds: a volume restored from the snapshot has
// the data of the snapshot's moment, a clone the data of its own; both are
// new volumes of their own id, idempotent by name, and outlive the
// snapshot and the source.
func TestSnapshotRestoreAndClone(t *testing.T) {
	tests := []struct {
		name string
		c    *csi.VolumeCapability
		size int64
	}{
		{"ext4", rwCap(volume.ModeFilesystem, "ext4"), 16 * mib},
		{"xfs", rwCap(volume.ModeFilesystem, "xfs"), 300 * mib},
		{"block", rwCap(volume.ModeBlock, ""), 4 * mib},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := newTestEnv(t)
			ctx := context.Background()
			mode := volume.ModeFilesystem
			if tc.c.GetBlock() != nil {
				mode = volume.ModeBlock
			}
			before, after := bytes.Repeat([]byte("before "), 1000), bytes.Repeat([]byte("after! "), 1000)
			src := e.createVolume(t, "src", tc.size, tc.c, nil)
			p := e.stageAndPublish(t, src.VolumeId, tc.c)
			writeData(t, mode, p.target, before)

			// The snapshot is taken while the volume is published, pinned
			// to this node as the CO would ask.
			ni, err := e.node.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
			if err != nil {
				t.Fatal(err)
			}
			snapReq := &csi.CreateSnapshotRequest{Name: "snap", SourceVolumeId: src.VolumeId,
				AccessibilityRequirements: &csi.TopologyRequirement{Requisite: []*csi.Topology{ni.AccessibleTopology}}}
			snap, err := e.ctrl.CreateSnapshot(ctx, snapReq)
			if err != nil {
				t.Fatalf("CreateSnapshot: %v", err)
			}
			s := snap.GetSnapshot()
			if !s.ReadyToUse || s.SourceVolumeId != src.VolumeId || s.SizeBytes != src.CapacityBytes || s.CreationTime == nil {
				t.Errorf("snapshot %+v of a %d-byte volume %s", s, src.CapacityBytes, src.VolumeId)
			}
			if len(s.AccessibleTopology) != 1 || !proto.Equal(s.AccessibleTopology[0], ni.AccessibleTopology) {
				t.Errorf("snapshot topology %v, want this node's %v only", s.AccessibleTopology, ni.AccessibleTopology)
			}
			again, err := e.ctrl.CreateSnapshot(ctx, snapReq)
			if err != nil || again.GetSnapshot().SnapshotId != s.SnapshotId || !again.GetSnapshot().CreationTime.AsTime().Equal(s.CreationTime.AsTime()) {
				t.Errorf("CreateSnapshot again: %v, %v; want the same snapshot", again, err)
			}
			writeData(t, mode, p.target, after)

			// Restore (twice as large) and clone.
			restoreReq := &csi.CreateVolumeRequest{
				Name: "restored", VolumeCapabilities: []*csi.VolumeCapability{tc.c},
				CapacityRange:       &csi.CapacityRange{RequiredBytes: 2 * tc.size},
				VolumeContentSource: snapSource(s.SnapshotId),
			}
			restored, err := e.ctrl.CreateVolume(ctx, restoreReq)
			if err != nil {
				t.Fatalf("CreateVolume from snapshot: %v", err)
			}
			cloned, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{
				Name: "cloned", VolumeCapabilities: []*csi.VolumeCapability{tc.c}, VolumeContentSource: volSource(src.VolumeId),
			})
			if err != nil {
				t.Fatalf("CreateVolume from volume: %v", err)
			}
			r, c := restored.GetVolume(), cloned.GetVolume()
			if r.VolumeId == src.VolumeId || c.VolumeId == src.VolumeId || r.VolumeId == c.VolumeId {
				t.Errorf("ids: source %s, restored %s, clone %s; want three", src.VolumeId, r.VolumeId, c.VolumeId)
			}
			if r.CapacityBytes != 2*tc.size || c.CapacityBytes != src.CapacityBytes {
				t.Errorf("capacity: restored %d (asked %d), clone %d (source %d)", r.CapacityBytes, 2*tc.size, c.CapacityBytes, src.CapacityBytes)
			}
			if r.GetContentSource().GetSnapshot().GetSnapshotId() != s.SnapshotId || c.GetContentSource().GetVolume().GetVolumeId() != src.VolumeId {
				t.Errorf("content sources: restored %v, clone %v", r.GetContentSource(), c.GetContentSource())
			}
			if len(r.AccessibleTopology) != 1 || r.AccessibleTopology[0].Segments[TopologyKey] != testNodeID {
				t.Errorf("restored volume topology %v, want this node", r.AccessibleTopology)
			}
			// Idempotent by name: the same request returns the same volume;
			// the name with another source is taken.
			if again, err := e.ctrl.CreateVolume(ctx, restoreReq); err != nil || again.GetVolume().VolumeId != r.VolumeId {
				t.Errorf("CreateVolume from snapshot again: %v, %v", again, err)
			}
			other := &csi.CreateVolumeRequest{Name: "restored", VolumeCapabilities: []*csi.VolumeCapability{tc.c},
				CapacityRange: restoreReq.CapacityRange, VolumeContentSource: volSource(src.VolumeId)}
			_, err = e.ctrl.CreateVolume(ctx, other)
			wantCode(t, err, codes.AlreadyExists)

			// Listing finds the snapshot by id and by source.
			for _, req := range []*csi.ListSnapshotsRequest{{SnapshotId: s.SnapshotId}, {SourceVolumeId: src.VolumeId}} {
				l, err := e.ctrl.ListSnapshots(ctx, req)
				if err != nil || len(l.Entries) != 1 || l.Entries[0].Snapshot.SnapshotId != s.SnapshotId {
					t.Errorf("ListSnapshots(%v) = %v, %v", req, l, err)
				}
			}
			if l, err := e.ctrl.ListSnapshots(ctx, &csi.ListSnapshotsRequest{SourceVolumeId: c.VolumeId}); err != nil || len(l.Entries) != 0 {
				t.Errorf("ListSnapshots of the clone = %v, %v; want none", l, err)
			}

			// The snapshot and the source go; the copies keep their data.
			if _, err := e.ctrl.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: s.SnapshotId}); err != nil {
				t.Fatalf("DeleteSnapshot: %v", err)
			}
			if _, err := e.ctrl.GetSnapshot(ctx, &csi.GetSnapshotRequest{SnapshotId: s.SnapshotId}); status.Code(err) != codes.NotFound {
				t.Errorf("GetSnapshot after delete: %v, want NotFound", err)
			}
			e.teardown(t, p)
			for _, v := range []struct {
				id   string
				want []byte
			}{{r.VolumeId, before}, {c.VolumeId, after}} {
				pv := e.stageAndPublish(t, v.id, tc.c)
				if got := readData(t, mode, pv.target, len(v.want)); !bytes.Equal(got, v.want) {
					t.Errorf("volume %s holds %.14q..., want %.14q...", v.id, got, v.want)
				}
				e.teardown(t, pv)
			}
		})
	}
}

// TestGroupSnapshot snapshots two volumes together and proves the group's
// life: both members carry the group id, Get agrees with the members
// named, a wrong list is refused, a member restores, Delete removes all.
func TestGroupSnapshot(t *testing.T) {
	e := newTestEnv(t)
	ctx := context.Background()
	fs := rwCap(volume.ModeFilesystem, "ext4")
	a, b := e.createVolume(t, "a", 16*mib, fs, nil), e.createVolume(t, "b", 16*mib, fs, nil)
	pa := e.stageAndPublish(t, a.VolumeId, fs)
	writeData(t, volume.ModeFilesystem, pa.target, []byte("member a"))

	req := &csi.CreateVolumeGroupSnapshotRequest{Name: "grp", SourceVolumeIds: []string{a.VolumeId, b.VolumeId}}
	resp, err := e.group.CreateVolumeGroupSnapshot(ctx, req)
	if err != nil {
		t.Fatalf("CreateVolumeGroupSnapshot: %v", err)
	}
	g := resp.GetGroupSnapshot()
	if g.GroupSnapshotId == "" || !g.ReadyToUse || len(g.Snapshots) != 2 {
		t.Fatalf("group snapshot %+v", g)
	}
	var ids, sources []string
	for _, s := range g.Snapshots {
		if s.GroupSnapshotId != g.GroupSnapshotId || !s.ReadyToUse {
			t.Errorf("member %+v of group %s", s, g.GroupSnapshotId)
		}
		ids, sources = append(ids, s.SnapshotId), append(sources, s.SourceVolumeId)
	}
	slices.Sort(sources)
	if want := []string{a.VolumeId, b.VolumeId}; !slices.Equal(sources, slices.Sorted(slices.Values(want))) {
		t.Errorf("members are of %v, want %v", sources, want)
	}
	again, err := e.group.CreateVolumeGroupSnapshot(ctx, req)
	if err != nil || again.GetGroupSnapshot().GroupSnapshotId != g.GroupSnapshotId {
		t.Errorf("CreateVolumeGroupSnapshot again: %v, %v", again, err)
	}
	_, err = e.group.CreateVolumeGroupSnapshot(ctx, &csi.CreateVolumeGroupSnapshotRequest{Name: "grp", SourceVolumeIds: []string{a.VolumeId}})
	wantCode(t, err, codes.AlreadyExists)

	got, err := e.group.GetVolumeGroupSnapshot(ctx, &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: g.GroupSnapshotId, SnapshotIds: ids})
	if err != nil || len(got.GetGroupSnapshot().Snapshots) != 2 {
		t.Errorf("GetVolumeGroupSnapshot: %v, %v", got, err)
	}
	_, err = e.group.GetVolumeGroupSnapshot(ctx, &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: g.GroupSnapshotId, SnapshotIds: ids[:1]})
	wantCode(t, err, codes.InvalidArgument)

	// A member is an ordinary snapshot: a volume restores from it.
	var ofA string
	for _, s := range g.Snapshots {
		if s.SourceVolumeId == a.VolumeId {
			ofA = s.SnapshotId
		}
	}
	r, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "from-member", VolumeCapabilities: []*csi.VolumeCapability{fs}, VolumeContentSource: snapSource(ofA)})
	if err != nil {
		t.Fatalf("CreateVolume from a member: %v", err)
	}
	pr := e.stageAndPublish(t, r.GetVolume().VolumeId, fs)
	if got := readData(t, volume.ModeFilesystem, pr.target, len("member a")); string(got) != "member a" {
		t.Errorf("volume from the member holds %q", got)
	}
	e.teardown(t, pr)
	e.teardown(t, pa)

	if _, err := e.group.DeleteVolumeGroupSnapshot(ctx, &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: g.GroupSnapshotId, SnapshotIds: ids}); err != nil {
		t.Fatalf("DeleteVolumeGroupSnapshot: %v", err)
	}
	for _, id := range ids {
		if _, err := e.ctrl.GetSnapshot(ctx, &csi.GetSnapshotRequest{SnapshotId: id}); status.Code(err) != codes.NotFound {
			t.Errorf("member %s after the group's delete: %v", id, err)
		}
	}
	_, err = e.group.GetVolumeGroupSnapshot(ctx, &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: g.GroupSnapshotId})
	wantCode(t, err, codes.NotFound)
}

// TestLogAttrsOfSnapshotRequests: a snapshot call is logged by its ids and
// name, never by its secrets or parameters.
func TestLogAttrsOfSnapshotRequests(t *testing.T) {
	secrets := map[string]string{"token": "s3cret"}
	tests := []struct {
		req  any
		want string
	}{
		{&csi.CreateSnapshotRequest{Name: "n", SourceVolumeId: "v", Secrets: secrets, Parameters: secrets}, "name=n source_volume_id=v"},
		{&csi.DeleteSnapshotRequest{SnapshotId: "s", Secrets: secrets}, "snapshot_id=s"},
		{&csi.ListSnapshotsRequest{SnapshotId: "s", SourceVolumeId: "v", Secrets: secrets}, "snapshot_id=s source_volume_id=v"},
		{&csi.CreateVolumeGroupSnapshotRequest{Name: "g", Secrets: secrets, Parameters: secrets}, "name=g"},
		{&csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: "g", Secrets: secrets}, "group_snapshot_id=g"},
	}
	for _, tc := range tests {
		if got := loggedAttrs(tc.req); got != tc.want {
			t.Errorf("%T: logged %q, want %q", tc.req, got, tc.want)
		}
	}
}

// loggedAttrs is what logAttrs makes of req, as key=value pairs joined by
// spaces.
func loggedAttrs(req any) string {
	attrs := logAttrs(req)
	var parts []string
	for i := 0; i+1 < len(attrs); i += 2 {
		parts = append(parts, fmt.Sprintf("%v=%v", attrs[i], attrs[i+1]))
	}
	return strings.Join(parts, " ")
}

// TestSnapshotDeleteWhileCreating deletes a snapshot, and a group
// snapshot, the moment the listing shows it being made: the delete is
// Aborted, and the create ends with a ready snapshot whose file is there,
// which a delete then removes.
func TestSnapshotDeleteWhileCreating(t *testing.T) {
	tests := []struct {
		name   string
		create func(e *testEnv, src string) error
		delete func(e *testEnv, id string) error
	}{
		{"snapshot", func(e *testEnv, src string) error {
			_, err := e.ctrl.CreateSnapshot(context.Background(), &csi.CreateSnapshotRequest{Name: "slow", SourceVolumeId: src})
			return err
		}, func(e *testEnv, id string) error {
			_, err := e.ctrl.DeleteSnapshot(context.Background(), &csi.DeleteSnapshotRequest{SnapshotId: id})
			return err
		}},
		{"group snapshot", func(e *testEnv, src string) error {
			_, err := e.group.CreateVolumeGroupSnapshot(context.Background(), &csi.CreateVolumeGroupSnapshotRequest{Name: "slow", SourceVolumeIds: []string{src}})
			return err
		}, func(e *testEnv, _ string) error {
			_, err := e.group.DeleteVolumeGroupSnapshot(context.Background(), &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: "slow"})
			return err
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := newTestEnv(t)
			ctx := context.Background()
			vol := e.createVolume(t, "big", 1*gib, rwCap(volume.ModeBlock, ""), nil)
			fillBacking(t, e, vol.VolumeId, 512*mib)
			done := make(chan error, 1)
			go func() { done <- tc.create(e, vol.VolumeId) }()
			id := creatingSnapshot(t, e, done)
			if err := tc.delete(e, id); status.Code(err) != codes.Aborted {
				t.Errorf("delete while the create runs: %v, want Aborted", err)
			}
			if err := <-done; err != nil {
				t.Fatalf("create: %v", err)
			}
			got, err := e.ctrl.GetSnapshot(ctx, &csi.GetSnapshotRequest{SnapshotId: id})
			if err != nil || !got.GetSnapshot().GetReadyToUse() {
				t.Fatalf("snapshot after its create: %v, %v", got, err)
			}
			sn, err := e.store.GetSnapshot(ctx, id)
			if err != nil || sn.Problem != "" {
				t.Fatalf("snapshot in the store: %+v, %v", sn, err)
			}
			if err := tc.delete(e, id); err != nil {
				t.Fatalf("delete once made: %v", err)
			}
			if sns, err := e.store.ListSnapshots(ctx); err != nil || len(sns) != 0 {
				t.Errorf("snapshots left: %v, %v", sns, err)
			}
		})
	}
}

// fillBacking writes n bytes of data at the start of volume id's backing
// file, so that a copy of it takes a while.
func fillBacking(t testing.TB, e *testEnv, id string, n int64) {
	t.Helper()
	v, err := e.store.Get(id)
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(v.BackingFile, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := bytes.Repeat([]byte("sparsevol"), int(mib)/9+1)[:mib]
	for off := int64(0); off < n; off += mib {
		if _, err := f.WriteAt(buf, off); err != nil {
			t.Fatal(err)
		}
	}
}

// creatingSnapshot polls ListSnapshots until it shows a snapshot not yet
// ready, and returns its id; done reports the create's end, which must
// not come first.
func creatingSnapshot(t testing.TB, e *testEnv, done <-chan error) string {
	t.Helper()
	for {
		select {
		case err := <-done:
			t.Fatalf("the create ended (%v) before the listing showed it running", err)
		default:
		}
		l, err := e.ctrl.ListSnapshots(context.Background(), &csi.ListSnapshotsRequest{})
		if err != nil {
			t.Fatal(err)
		}
		for _, s := range l.GetEntries() {
			if !s.GetSnapshot().GetReadyToUse() {
				return s.GetSnapshot().GetSnapshotId()
			}
		}
	}
}
