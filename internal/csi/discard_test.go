package csi

import (
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/sparsevol/sparsevol/internal/volume"
)

// TestParseDiscard: the discard StorageClass parameter is accepted for
// thin filesystem volumes only.
func TestParseDiscard(t *testing.T) {
	fs := rwCap(volume.ModeFilesystem, "")
	block := rwCap(volume.ModeBlock, "")
	tests := []struct {
		name    string
		cap     *csi.VolumeCapability
		params  map[string]string
		code    codes.Code
		discard bool
	}{
		{"default off", fs, nil, codes.OK, false},
		{"on", fs, map[string]string{ParamDiscard: "true"}, codes.OK, true},
		{"off", fs, map[string]string{ParamDiscard: "false"}, codes.OK, false},
		{"bad value", fs, map[string]string{ParamDiscard: "sometimes"}, codes.InvalidArgument, false},
		{"thick", fs, map[string]string{ParamDiscard: "true", ParamProvisioning: "thick"}, codes.InvalidArgument, false},
		{"thick, off", fs, map[string]string{ParamDiscard: "false", ParamProvisioning: "thick"}, codes.OK, false},
		{"block", block, map[string]string{ParamDiscard: "true"}, codes.InvalidArgument, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s, err := parseRequest([]*csi.VolumeCapability{tc.cap}, tc.params, &csi.CapacityRange{RequiredBytes: 512 * mib})
			if status.Code(err) != tc.code {
				t.Fatalf("error %v, want code %s", err, tc.code)
			}
			if err == nil && s.discard != tc.discard {
				t.Errorf("discard %v, want %v", s.discard, tc.discard)
			}
		})
	}
}
