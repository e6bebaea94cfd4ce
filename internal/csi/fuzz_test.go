package csi

import (
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/sparsevol/sparsevol/internal/volume"
)

// FuzzParseParameters feeds StorageClass parameters and a capability
// through parseRequest. Whatever it accepts is a request volume accepts as
// it is, with a size in range; whatever it refuses is a client error.
func FuzzParseParameters(f *testing.F) {
	type seed struct {
		block                                       bool
		capFS, fsType, mkfs, provisioning, directIO string
		discard, extraKey                           string
		required, limit                             int64
	}
	for _, s := range []seed{
		{capFS: "", mkfs: "-b 4096 -L data"},
		{capFS: "xfs", mkfs: "-l logdev=/some/file,size=64m"},
		{capFS: "xfs", mkfs: "-d name=/etc/shadow"},
		{mkfs: "-d /etc"},
		{mkfs: "-Urandom"},
		{capFS: "xfs", mkfs: "-muuid=11111111-1111-1111-1111-111111111111"},
		{mkfs: "-n"},
		{capFS: "xfs", mkfs: "-N"},
		{capFS: "xfs", fsType: "xfs", mkfs: "-m crc=1,reflink=1 -K", provisioning: "thick"},
		{capFS: "ext4", fsType: "xfs"},
		{block: true, fsType: "ext4"},
		{block: true, mkfs: "-K"},
		{block: true, discard: "true"},
		{provisioning: "thick", discard: "true"},
		{provisioning: "fat", directIO: "maybe"},
		{capFS: "btrfs"},
		{extraKey: "csi.storage.k8s.io/pvc/name"},
		{extraKey: "provisionning"},
		{required: -1 << 20},
		{limit: -1},
		{required: 10 << 20, limit: 5 << 20},
		{required: 1, limit: 2 << 20},
		{required: 1<<62 + 1},
	} {
		f.Add(s.block, s.capFS, s.fsType, s.mkfs, s.provisioning, s.directIO, s.discard, s.extraKey, s.required, s.limit)
	}
	f.Fuzz(func(t *testing.T, block bool, capFS, fsType, mkfs, provisioning, directIO, discard, extraKey string, required, limit int64) {
		c := &csi.VolumeCapability{
			AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: capFS}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
		}
		if block {
			c.AccessType = &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}
		}
		params := map[string]string{}
		for k, v := range map[string]string{ParamFSType: fsType, ParamMkfsOptions: mkfs, ParamProvisioning: provisioning,
			ParamDirectIO: directIO, ParamDiscard: discard, extraKey: "x"} {
			if k != "" && v != "" {
				params[k] = v
			}
		}
		s, err := parseRequest([]*csi.VolumeCapability{c}, params, &csi.CapacityRange{RequiredBytes: required, LimitBytes: limit})
		if err != nil {
			if code := status.Code(err); code != codes.InvalidArgument && code != codes.OutOfRange {
				t.Fatalf("parseRequest(%v, %q, %d..%d): %v, want InvalidArgument or OutOfRange", block, params, required, limit, err)
			}
			return
		}
		// What parseRequest accepts, volume accepts unchanged.
		req := s.req
		req.Name = "fuzz"
		if err := req.Normalize(); err != nil {
			t.Fatalf("parseRequest accepted %q, volume refuses it: %v", params, err)
		}
		if req.SizeBytes != s.req.SizeBytes || req.FSType != s.req.FSType || req.Mode != s.req.Mode ||
			strings.Join(req.MkfsOptions, " ") != strings.Join(s.req.MkfsOptions, " ") {
			t.Fatalf("parseRequest(%q) = %+v, normalized again %+v", params, s.req, req)
		}
		if opts, err := volume.NormalizeMkfsOptions(req.FSType, req.MkfsOptions); err != nil || strings.Join(opts, " ") != strings.Join(req.MkfsOptions, " ") {
			t.Fatalf("parseRequest accepted mkfs options %q: %v", req.MkfsOptions, err)
		}
		for _, tok := range req.MkfsOptions {
			if strings.ContainsRune(tok, '/') || strings.Contains(tok, "uuid") {
				t.Fatalf("parseRequest accepted the mkfs option %q", tok)
			}
		}
		if block != (req.Mode == volume.ModeBlock) || (!block && capFS != "" && req.FSType != capFS) {
			t.Fatalf("capability (block %v, fs %q) became %+v", block, capFS, req)
		}
		if req.SizeBytes < required || (limit > 0 && req.SizeBytes > limit) || req.SizeBytes%volume.MiB != 0 {
			t.Fatalf("size %d outside %d..%d or not whole MiB", req.SizeBytes, required, limit)
		}
	})
}
