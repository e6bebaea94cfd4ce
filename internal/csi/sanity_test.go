package csi

import (
	"context"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"

	"github.com/kubernetes-csi/csi-test/v5/pkg/sanity"
	. "github.com/onsi/ginkgo/v2"
	"github.com/onsi/ginkgo/v2/types"
	. "github.com/onsi/gomega"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	"github.com/sparsevol/sparsevol/internal/testutil"
	"github.com/sparsevol/sparsevol/internal/volume"
)

// expectedSkips are the sanity specs that skip themselves against this
// driver, keyed by the message the suite skips with, and why that is right.
var expectedSkips = map[string]string{
	"ControllerPublishVolume not supported":                "volumes are node-local files: there is no controller attach step",
	"ControllerUnpublishVolume not supported":              "no controller attach step (see ControllerPublishVolume)",
	"Controller Publish, UnpublishVolume not supported":    "no controller attach step (see ControllerPublishVolume)",
	"ControllerPublishVolume.readonly field not supported": "no controller attach step (see ControllerPublishVolume)",
	"testnodevolumeattachlimit not enabled":                "the attach-limit spec goes through ControllerPublishVolume, which this driver has no use for",
	"ControllerGetVolumeHealth not supported":              "volume health is reported by the node service (NodeGetVolumeHealth), where the device lives",
	"ControllerListVolumeHealth not supported":             "volume health is reported by the node service (NodeGetVolumeHealth), where the device lives",
	noResourceCapSkip: "ext4 online resize (EXT4_IOC_RESIZE_FS) needs CAP_SYS_RESOURCE, which this host withholds even from root",
}

const noResourceCapSkip = "online ext4 resize needs CAP_SYS_RESOURCE (CapEff bit 24), which this process lacks"

// sizedReplies computes the encoded size of every reply the suite
// receives. Marshaling caches a message's size inside it, and the suite
// compares some messages with reflect.DeepEqual: the snapshot topology
// spec compares the topology a CreateSnapshot reply carries (never
// marshaled on this side) with the NodeGetInfo topology it sent in the
// request (marshaled, so its cache is set), which differ in that cache
// alone. Sizing every reply makes the comparison one of values.
func sizedReplies(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	err := invoker(ctx, method, req, reply, cc, opts...)
	if m, ok := reply.(proto.Message); ok {
		proto.Size(m)
	}
	return err
}

// sanityConfigs are the three ways the driver is proven.
var sanityConfigs = []struct {
	name       string
	accessType string
	params     map[string]string
}{
	{"mount-ext4", "mount", map[string]string{ParamFSType: "ext4"}},
	{"mount-xfs", "mount", map[string]string{ParamFSType: "xfs"}},
	{"block", "block", nil},
}

// uuidGen makes volume ids of the driver's form (UUIDs).
type uuidGen struct{ sanity.DefaultIDGenerator }

func (uuidGen) GenerateUniqueValidVolumeID() string { return volume.NewUUID() }

// TestSanity runs the CSI conformance suite against the real driver, once
// per configuration, in one Ginkgo run (Ginkgo allows one per process).
func TestSanity(t *testing.T) {
	envs := make([]*testEnv, len(sanityConfigs))
	for i, c := range sanityConfigs {
		envs[i] = newTestEnv(t)
		cfg := sanity.NewTestConfig()
		cfg.Address = "unix://" + envs[i].socket
		cfg.TargetPath = filepath.Join(envs[i].kubelet, "target")
		cfg.StagingPath = filepath.Join(envs[i].kubelet, "staging")
		cfg.TestVolumeAccessType = c.accessType
		cfg.TestVolumeParameters = c.params
		// Large enough for XFS (300 MiB minimum); sparse, so cheap.
		cfg.TestVolumeSize = 512 << 20
		cfg.IDGen = uuidGen{}
		cfg.IdempotentCount = 3
		cfg.DialOptions = append(cfg.DialOptions, grpc.WithChainUnaryInterceptor(sizedReplies))
		cfg.ControllerDialOptions = append(cfg.ControllerDialOptions, grpc.WithChainUnaryInterceptor(sizedReplies))
		// A VolumeAttributesClass every configuration takes on any host
		// (limits need cgroup v2's io controller; the modify tests cover
		// them).
		cfg.TestVolumeMutableParameters = map[string]string{ParamDirectIO: "true"}
		name, ext4 := c.name, c.params[ParamFSType] == "ext4"
		Describe(name, func() {
			BeforeEach(func() {
				if ext4 && testutil.CapSysResource() != nil && strings.Contains(CurrentSpecReport().FullText(), "node-expand is called after node-publish") {
					Skip(noResourceCapSkip)
				}
			})
			sanity.GinkgoTest(&cfg)
		})
	}

	var mu sync.Mutex
	type tally struct{ passed, failed, skipped, pending int }
	tallies := map[string]*tally{}
	skips := map[string]map[string]int{} // config -> message -> count
	ReportAfterEach(func(r SpecReport) {
		if len(r.ContainerHierarchyTexts) == 0 {
			return
		}
		cfg := r.ContainerHierarchyTexts[0]
		mu.Lock()
		defer mu.Unlock()
		tl := tallies[cfg]
		if tl == nil {
			tl = &tally{}
			tallies[cfg] = tl
			skips[cfg] = map[string]int{}
		}
		switch {
		case r.State.Is(types.SpecStatePassed):
			tl.passed++
		case r.State.Is(types.SpecStatePending):
			tl.pending++
		case r.State.Is(types.SpecStateSkipped):
			tl.skipped++
			skips[cfg][r.Failure.Message]++
		default:
			tl.failed++
		}
	})

	RegisterFailHandler(Fail)
	suite, reporter := GinkgoConfiguration()
	reporter.Succinct = !testing.Verbose()
	RunSpecs(t, "sparsevol CSI sanity", suite, reporter)

	configs := make([]string, 0, len(tallies))
	for c := range tallies {
		configs = append(configs, c)
	}
	sort.Strings(configs)
	for _, c := range configs {
		tl := tallies[c]
		t.Logf("sanity %-10s passed %d, failed %d, skipped %d, pending (disabled upstream) %d", c, tl.passed, tl.failed, tl.skipped, tl.pending)
		msgs := make([]string, 0, len(skips[c]))
		for m := range skips[c] {
			msgs = append(msgs, m)
		}
		sort.Strings(msgs)
		for _, m := range msgs {
			reason, ok := expectedSkips[m]
			if !ok {
				t.Errorf("sanity %s: %d spec(s) skipped for an unexpected reason: %q", c, skips[c][m], m)
				continue
			}
			t.Logf("  skipped %2d × %q: %s", skips[c][m], m, reason)
		}
	}
	if len(tallies) != len(sanityConfigs) {
		t.Errorf("sanity ran %d configurations, want %d", len(tallies), len(sanityConfigs))
	}
}
