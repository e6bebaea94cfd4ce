// Command k8s-bins builds (or finds in the cache) the Kubernetes binaries of
// the k8s end-to-end test and prints each binary's path.
//
//	go run ./test/k8s/cmd/k8s-bins [-cache DIR] [-nice N]
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/sparsevol/sparsevol/test/k8s/bins"
)

func main() {
	cache := flag.String("cache", bins.DefaultCache(), "cache root (default: k8s-bins under $SPARSEVOL_E2E_CACHE)")
	nice := flag.Int("nice", 19, "niceness of the go builds (0: unchanged)")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	res, err := bins.Ensure(ctx, bins.Options{Cache: *cache, Nice: *nice, Log: os.Stderr})
	if err != nil {
		fmt.Fprintln(os.Stderr, "k8s-bins:", err)
		os.Exit(1)
	}
	if res.Cached {
		fmt.Fprintf(os.Stderr, "k8s-bins: cached (%s)\n", res.Elapsed.Round(1e6))
	} else {
		fmt.Fprintf(os.Stderr, "k8s-bins: built in %s\n", res.Elapsed.Round(1e9))
		for k, v := range res.Steps {
			fmt.Fprintf(os.Stderr, "k8s-bins:   %s %s\n", k, v.Round(1e9))
		}
	}
	for _, n := range bins.Names {
		fmt.Println(res.Path(n))
	}
}
