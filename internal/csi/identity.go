package csi

import (
	"context"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// GetPluginInfo returns the driver name and version.
func (d *Driver) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: d.name, VendorVersion: d.version}, nil
}

// GetPluginCapabilities advertises the controller and group controller
// services, topology (of volumes and of snapshots) and online expansion.
func (d *Driver) GetPluginCapabilities(context.Context, *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	services := capabilities([]csi.PluginCapability_Service_Type{
		csi.PluginCapability_Service_CONTROLLER_SERVICE,
		csi.PluginCapability_Service_VOLUME_ACCESSIBILITY_CONSTRAINTS,
		csi.PluginCapability_Service_GROUP_CONTROLLER_SERVICE,
		csi.PluginCapability_Service_SNAPSHOT_ACCESSIBILITY_CONSTRAINTS,
	}, func(t csi.PluginCapability_Service_Type) *csi.PluginCapability {
		return &csi.PluginCapability{Type: &csi.PluginCapability_Service_{Service: &csi.PluginCapability_Service{Type: t}}}
	})
	expansion := &csi.PluginCapability{Type: &csi.PluginCapability_VolumeExpansion_{VolumeExpansion: &csi.PluginCapability_VolumeExpansion{
		Type: csi.PluginCapability_VolumeExpansion_ONLINE,
	}}}
	return &csi.GetPluginCapabilitiesResponse{Capabilities: append(services, expansion)}, nil
}

// capabilities builds a capability list from the types it advertises:
// the one way the driver's capability lists are made.
func capabilities[T, C any](types []T, build func(T) C) []C {
	out := make([]C, len(types))
	for i, t := range types {
		out[i] = build(t)
	}
	return out
}

// Probe checks what every operation needs: a readable, writable store
// and the loop control device. A failure is an error (the livenessprobe
// restarts the plugin), not a "not ready" answer.
func (d *Driver) Probe(context.Context, *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	if err := d.healthy(); err != nil {
		return nil, status.Error(codes.FailedPrecondition, err.Error())
	}
	return &csi.ProbeResponse{Ready: wrapperspb.Bool(true)}, nil
}

func (d *Driver) healthy() error { return d.store.Check() }
