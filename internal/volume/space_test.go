package volume

import (
	"math"
	"testing"
)

// TestSpaceHugeRatio: a ratio whose limit does not fit in an int64 promises
// the most there is, not nothing (the conversion of the product used to be
// math.MinInt64 on amd64, and only wrapped round by luck when volumes
// existed).
func TestSpaceHugeRatio(t *testing.T) {
	for _, ratio := range []float64{1e9, 1e300} {
		s := newStore(t, Options{OvercommitRatio: ratio})
		sp, err := s.Space()
		if err != nil || sp.CapacityBytes < math.MaxInt64/4 {
			t.Errorf("ratio %g: capacity %d (%v), want at least %d", ratio, sp.CapacityBytes, err, int64(math.MaxInt64/4))
		}
		rawVolume(t, s, "v")
	}
}
