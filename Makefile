# sparsevol — build, test, install.
PREFIX   ?= /usr/local
BINDIR   ?= $(PREFIX)/bin
UNITDIR  ?= /etc/systemd/system
UDEVDIR  ?= /etc/udev/rules.d
MANDIR   ?= $(PREFIX)/share/man
STORE    ?= /var/lib/sparsevol
DESTDIR  ?=
# sudo resets PATH; find Go where the official tarball puts it.
GO       ?= $(shell command -v go 2>/dev/null || echo /usr/local/go/bin/go)
GOFMT    ?= $(dir $(GO))gofmt
GOFLAGS  ?= -trimpath
TEST_TIMEOUT ?= 30m
# The version stamped into the binary, its manual pages and the packages:
# 0.0.0+git<commit time, UTC>.<commit> unless given.
VERSION  ?= $(shell TZ=UTC git log -1 --format='0.0.0+git%cd.%h' --date=format-local:%Y%m%d%H%M%S 2>/dev/null || echo 0.0.0+unknown)
# One time for every file the build writes (manual pages, packages): the
# commit's, so two builds of a commit are the same bytes.
SOURCE_DATE_EPOCH ?= $(shell git log -1 --format=%ct 2>/dev/null || echo 0)
export SOURCE_DATE_EPOCH
# -s -w: no symbol table or DWARF (a third of the size; panics still name
# functions).
LDFLAGS  = -s -w -X github.com/sparsevol/sparsevol/internal/cli.version=$(VERSION)

.PHONY: all build man test test-short install uninstall packages bench bench-go bench-report e2e clean vet

all: build

# Two static binaries from the same packages (each runs on any node, and
# in the plugin image, as is): bin/sparsevol, the node commands and what
# the units run, and bin/sparsevol-csi, the CSI plugin. The plugin's stack
# (gRPC, protobuf, Prometheus) is linked into sparsevol-csi only: every
# package a binary links is initialised at each of its starts
# (docs/design.md, "Two binaries").
# -buildvcs=auto: `sparsevol version` names the commit even where the
# environment's GOFLAGS turns stamping off; VERSION is its version.
BINARIES = sparsevol sparsevol-csi
build:
	for b in $(BINARIES); do \
		CGO_ENABLED=0 $(GO) build $(GOFLAGS) -buildvcs=auto -ldflags '$(LDFLAGS)' -o bin/$$b ./cmd/$$b || exit 1; \
	done

# The manual pages, generated from the command trees (sparsevol.8 and one
# page per subcommand, sparsevol-csi.8) by tools/man, which is not shipped.
man:
	rm -rf bin/man && $(GO) run $(GOFLAGS) -ldflags '$(LDFLAGS)' ./tools/man -dir bin/man

vet:
	@unformatted=$$($(GOFMT) -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$unformatted" ]; then echo "not gofmt-formatted (run gofmt -w):"; echo "$$unformatted"; exit 1; fi
	$(GO) vet ./...
	$(GO) vet -tags crashtest ./...
	$(GO) -C tools/packages vet ./...
	$(GO) -C tools/image vet ./...
	$(GO) -C deploy/helm vet ./...

# The test command of the README and of CI. Needs root: real loop devices,
# mkfs and mounts. -tags crashtest compiles in the crash points the
# crash-safety tests kill the CLI at (never in the shipped binary). Then
# each fuzz target runs for FUZZTIME_TEST, a count of executions: go1.26's
# fuzz coordinator can fail a duration-bounded run at its deadline with
# "context deadline exceeded" and no failing input (go.dev/issue/75804).
test: build vet
	$(GO) test -count=1 -tags crashtest -timeout $(TEST_TIMEOUT) ./...
	$(GO) -C tools/image test -count=1 -timeout $(TEST_TIMEOUT) ./...
	$(GO) -C deploy/helm test -count=1 -timeout $(TEST_TIMEOUT) ./...
	@$(MAKE) --no-print-directory fuzz FUZZTIME=$(FUZZTIME_TEST)

# The Go fuzz targets (package:target), each run for FUZZTIME: -fuzz takes
# one target per run. A failing input is written to the package's
# testdata/fuzz and fails the run; commit it as a regression case.
FUZZ_TARGETS = \
	./internal/volume:FuzzParseSize \
	./internal/volume:FuzzValidateName \
	./internal/volume:FuzzMkfsOptions \
	./internal/volume:FuzzReadStream \
	./internal/csi:FuzzParseParameters
FUZZTIME ?= 60s
FUZZTIME_TEST ?= 100000x

.PHONY: fuzz
fuzz:
	@log=$$(mktemp); trap 'rm -f $$log' EXIT; \
	for t in $(FUZZ_TARGETS); do \
		pkg=$${t%%:*}; name=$${t##*:}; \
		echo "fuzz $$name ($$pkg) for $(FUZZTIME)"; \
		$(GO) test -run '^$$' -fuzz "^$$name\$$" -fuzztime $(FUZZTIME) -fuzzminimizetime 5s $$pkg > $$log 2>&1 || { cat $$log; exit 1; }; \
		grep -E '^fuzz: elapsed' $$log | tail -1; \
	done

# Both binaries, their manual pages, the udev rule (deploy/udev), and what
# `sparsevol units install` writes (the units for $(BINDIR)/sparsevol and
# $(STORE), the boot generator link beside UNITDIR): the binary renders its
# own units, nothing here edits them. With DESTDIR (a root being staged)
# systemd is not reloaded.
install: build man
	install -D -m 0755 bin/sparsevol $(DESTDIR)$(BINDIR)/sparsevol
	install -D -m 0755 bin/sparsevol-csi $(DESTDIR)$(BINDIR)/sparsevol-csi
	install -d -m 0755 $(DESTDIR)$(MANDIR)/man8
	install -m 0644 bin/man/*.8 $(DESTDIR)$(MANDIR)/man8/
	install -D -m 0644 deploy/udev/59-sparsevol.rules $(DESTDIR)$(UDEVDIR)/59-sparsevol.rules
	bin/sparsevol --root $(STORE) --unit-dir $(DESTDIR)$(UNITDIR) units install \
		--binary $(BINDIR)/sparsevol $(if $(DESTDIR),--offline)
	install -d -m 0700 $(DESTDIR)$(STORE)

uninstall: build
	bin/sparsevol --unit-dir $(DESTDIR)$(UNITDIR) units uninstall $(if $(DESTDIR),--offline)
	rm -f $(DESTDIR)$(BINDIR)/sparsevol $(DESTDIR)$(BINDIR)/sparsevol-csi $(DESTDIR)$(UDEVDIR)/59-sparsevol.rules
	rm -f $(DESTDIR)$(MANDIR)/man8/sparsevol.8 $(DESTDIR)$(MANDIR)/man8/sparsevol-*.8

# The node packages, bin/packages/sparsevol_<version>_amd64.deb and
# sparsevol-<version>.x86_64.rpm: `make install` into a staged root with
# the packages' layout (/usr/bin, units in /usr/lib/systemd/system), packed
# with the maintainer scripts of deploy/packages by nfpm, run as a Go
# program from its own module (tools/packages). Reproducible: every file
# dated SOURCE_DATE_EPOCH. README "Install on a node" says what install,
# upgrade and remove do; deploy/packages' test checks the packages.
PKGROOT ?= $(CURDIR)/bin/pkgroot
PKGDIR  ?= $(CURDIR)/bin/packages
packages:
	rm -rf $(PKGROOT) $(PKGDIR)
	$(MAKE) --no-print-directory install DESTDIR=$(PKGROOT) PREFIX=/usr UNITDIR=/usr/lib/systemd/system UDEVDIR=/usr/lib/udev/rules.d STORE=/var/lib/sparsevol
	$(GO) -C tools/packages run . -root $(PKGROOT) -scripts $(CURDIR)/deploy/packages \
		-version '$(VERSION)' -mtime $(SOURCE_DATE_EPOCH) -out $(PKGDIR)

# The issue-5 report: fio through volumes against the backing file,
# attach/detach of 1000 volumes against losetup, create latency, space
# given back by trim, peak RSS. Writes bench/REPORT.md and bench/report.svg
# and prints the table. Needs root and fio; takes about ten minutes (three
# rounds of everything, for medians on a shared machine).
# BENCH_FLAGS passes options, e.g. BENCH_FLAGS="-rounds 1" for a quicker run.
BENCH_FLAGS ?=
# Everything measured: the Go benchmarks (engine vs losetup at 200 volumes,
# create latency, peak RSS of attach --all, idle RSS of the CSI plugin),
# then bench/REPORT.md and bench/report.svg from one run.
bench: bench-go bench-report

bench-report: build
	$(GO) run ./bench/report -out bench -bin bin/sparsevol $(BENCH_FLAGS)

# The Go benchmarks (engine vs losetup at 200 volumes, create, RSS).
bench-go: build
	$(GO) test -run '^$$' -bench . -benchtime 1x -count 1 -timeout 30m ./internal/... ./bench/...

clean:
	rm -rf bin

# The plugin image, built without a container daemon (tools/image, its own
# Go module): bin/sparsevol-csi plus the tools it runs, from the host's Debian
# packages (cached in IMAGE_CACHE by version). bin/sparsevol-image.tar is
# an OCI layout that is also a docker archive: `ctr images import`,
# `docker load` and `podman load` read it. Timestamps are the commit's
# (SOURCE_DATE_EPOCH above), so a commit always gives the same digest.
# `make image-push IMAGE=reg/name:tag` pushes it (credentials: docker's
# config, e.g. `docker login`).
IMAGE       ?= ghcr.io/sparsevol/sparsevol:latest
IMAGE_CACHE ?= /var/cache/sparsevol-image
.PHONY: image image-push
image: build
	$(GO) -C tools/image run . -bin $(CURDIR)/bin/sparsevol-csi -name $(IMAGE) -cache $(IMAGE_CACHE) -out $(CURDIR)/bin/sparsevol-image.tar

image-push: build
	$(GO) -C tools/image run . -bin $(CURDIR)/bin/sparsevol-csi -name $(IMAGE) -cache $(IMAGE_CACHE) -push $(IMAGE)

# The VM reboot test (test/vm, see its README): builds a Debian image once
# (test/e2e/vmrun, cached under $${SPARSEVOL_E2E_CACHE:-/var/cache/sparsevol-e2e}), installs
# this checkout into a copy with `make install DESTDIR=...` and boots it under
# qemu (software emulation). Needs root, qemu-system-x86 and debootstrap.
e2e:
	$(GO) test -tags e2e -v -count=1 -timeout 60m ./test/vm/

# The Kubernetes end-to-end test (test/k8s, see its README): a one-node
# cluster (kubelet, control plane and etcd built from their Go modules and
# cached under $${SPARSEVOL_E2E_CACHE:-/var/cache/sparsevol-e2e}/k8s-bins,
# containerd from Debian) in a VM made from the shared base image (test/e2e/vmrun); pods on node-mode and CSI
# volumes across a reboot. Needs root, qemu-system-x86 and debootstrap.
.PHONY: e2e-k8s
e2e-k8s:
	$(GO) test -tags e2e -v -count=1 -timeout 150m ./test/k8s/
