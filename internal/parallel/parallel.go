// Package parallel runs independent pieces of work on a bounded number of
// goroutines: the one worker pool of the loop layer's batch binds and the
// store's batch reads and publishes.
package parallel

import "sync"

// For calls fn(0) … fn(n-1), each once, on up to workers goroutines (at
// least one), and returns when all calls have returned. fn must be safe to
// call concurrently for different i.
func For(n, workers int, fn func(i int)) {
	if n <= 0 {
		return
	}
	var wg sync.WaitGroup
	next := make(chan int)
	for range max(1, min(workers, n)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				fn(i)
			}
		}()
	}
	for i := range n {
		next <- i
	}
	close(next)
	wg.Wait()
}
