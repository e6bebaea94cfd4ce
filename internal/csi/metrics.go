package csi

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/sparsevol/sparsevol/internal/volume"
)

// Metrics holds the plugin's Prometheus collectors, on a registry of its
// own. Call metrics are recorded by the server's interceptor; volume
// gauges are read from the store at scrape time, so they cannot go stale.
type Metrics struct {
	Registry   *prometheus.Registry
	operations *prometheus.CounterVec
	errors     *prometheus.CounterVec
	latency    *prometheus.HistogramVec
	restages   prometheus.Counter
}

// NewMetrics registers the collectors; store may be nil (no volume gauges).
func NewMetrics(store *volume.Store) *Metrics {
	m := &Metrics{
		Registry: prometheus.NewRegistry(),
		operations: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "sparsevol", Subsystem: "csi", Name: "operations_total",
			Help: "CSI calls served, by method and gRPC code.",
		}, []string{"method", "code"}),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "sparsevol", Subsystem: "csi", Name: "operation_errors_total",
			Help: "CSI calls that returned an error, by method and gRPC code.",
		}, []string{"method", "code"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "sparsevol", Subsystem: "csi", Name: "operation_duration_seconds",
			Help:    "Latency of CSI calls, by method.",
			Buckets: []float64{.001, .005, .01, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60},
		}, []string{"method"}),
		restages: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "sparsevol", Subsystem: "csi", Name: "restages_total",
			Help: "Volumes staged again by NodePublishVolume because their device or staging mount was gone.",
		}),
	}
	m.Registry.MustRegister(m.operations, m.errors, m.latency, m.restages)
	if store != nil {
		m.Registry.MustRegister(volumeCollector{store: store})
	}
	return m
}

func (m *Metrics) observe(method, code string, d time.Duration) {
	if m == nil {
		return
	}
	m.operations.WithLabelValues(method, code).Inc()
	if code != "OK" {
		m.errors.WithLabelValues(method, code).Inc()
	}
	m.latency.WithLabelValues(method).Observe(d.Seconds())
}

func (m *Metrics) restaged() {
	if m != nil {
		m.restages.Inc()
	}
}

var (
	volumesDesc = prometheus.NewDesc("sparsevol_volumes", "Volumes in the store, by mode, filesystem and owner.",
		[]string{"mode", "fs_type", "managed_by"}, nil)
	logicalDesc = prometheus.NewDesc("sparsevol_volume_logical_bytes", "Logical size of each volume.",
		[]string{"volume_id", "name"}, nil)
	allocatedDesc = prometheus.NewDesc("sparsevol_volume_allocated_bytes", "Bytes the backing file of each volume really occupies.",
		[]string{"volume_id", "name"}, nil)
	capacityDesc = prometheus.NewDesc("sparsevol_store_capacity_bytes", "What the store can still promise under its overcommit policy.",
		nil, nil)
	scrapeErrDesc = prometheus.NewDesc("sparsevol_store_scrape_errors", "1 if reading the store for this scrape failed.", nil, nil)
)

// volumeCollector reads the store at scrape time.
type volumeCollector struct{ store *volume.Store }

func (c volumeCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{volumesDesc, logicalDesc, allocatedDesc, capacityDesc, scrapeErrDesc} {
		ch <- d
	}
}

func (c volumeCollector) Collect(ch chan<- prometheus.Metric) {
	failed := 0.0
	sts, err := c.store.Statuses()
	if err != nil {
		failed = 1
	}
	type key struct{ mode, fs, owner string }
	counts := map[key]int{}
	for _, st := range sts {
		owner := st.Labels[LabelManagedBy]
		if owner == "" {
			owner = "node"
		}
		counts[key{string(st.Mode), st.FSType, owner}]++
		ch <- prometheus.MustNewConstMetric(logicalDesc, prometheus.GaugeValue, float64(st.SizeBytes), st.UUID, st.Name)
		ch <- prometheus.MustNewConstMetric(allocatedDesc, prometheus.GaugeValue, float64(st.AllocatedBytes), st.UUID, st.Name)
	}
	for k, n := range counts {
		ch <- prometheus.MustNewConstMetric(volumesDesc, prometheus.GaugeValue, float64(n), k.mode, k.fs, k.owner)
	}
	if sp, err := c.store.Space(); err == nil {
		ch <- prometheus.MustNewConstMetric(capacityDesc, prometheus.GaugeValue, float64(sp.CapacityBytes))
	} else {
		failed = 1
	}
	ch <- prometheus.MustNewConstMetric(scrapeErrDesc, prometheus.GaugeValue, failed)
}
