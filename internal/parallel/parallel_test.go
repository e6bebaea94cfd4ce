package parallel

import (
	"sync/atomic"
	"testing"
)

func TestFor(t *testing.T) {
	tests := []struct{ n, workers int }{{0, 4}, {1, 4}, {10, 1}, {100, 8}, {5, 0}, {3, 10}}
	for _, tt := range tests {
		calls := make([]atomic.Int32, tt.n)
		var running, peak atomic.Int32
		For(tt.n, tt.workers, func(i int) {
			now := running.Add(1)
			for {
				p := peak.Load()
				if now <= p || peak.CompareAndSwap(p, now) {
					break
				}
			}
			calls[i].Add(1)
			running.Add(-1)
		})
		for i := range calls {
			if got := calls[i].Load(); got != 1 {
				t.Errorf("For(%d, %d): fn(%d) called %d times", tt.n, tt.workers, i, got)
			}
		}
		if limit := int32(max(1, tt.workers)); peak.Load() > limit {
			t.Errorf("For(%d, %d): %d calls at once, limit %d", tt.n, tt.workers, peak.Load(), limit)
		}
	}
}
