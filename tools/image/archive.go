package main

import (
	"archive/tar"
	"encoding/json"
	"fmt"
	"io"
	"sort"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// Annotations of the index entry: the name containerd (ctr images
// import, docker load of an OCI layout) and podman give the image.
const (
	annotationContainerdName = "io.containerd.image.name"
	annotationRefName        = "org.opencontainers.image.ref.name"
)

// writeArchive writes img as one tar that is both an OCI image layout
// (oci-layout, index.json, blobs/sha256/...: ctr images import, podman
// load, skopeo oci-archive:) and a docker save archive (manifest.json
// naming the same blobs: docker load). Entries are sorted and stamped
// with epoch, so equal images give equal archives.
func writeArchive(w io.Writer, img v1.Image, name string, epoch time.Time) error {
	blobs := map[string][]byte{}
	addBlob := func(h v1.Hash, data []byte) string {
		p := "blobs/" + h.Algorithm + "/" + h.Hex
		blobs[p] = data
		return p
	}
	manifest, err := img.RawManifest()
	if err != nil {
		return err
	}
	digest, err := img.Digest()
	if err != nil {
		return err
	}
	addBlob(digest, manifest)
	config, err := img.RawConfigFile()
	if err != nil {
		return err
	}
	configName, err := img.ConfigName()
	if err != nil {
		return err
	}
	configPath := addBlob(configName, config)
	layers, err := img.Layers()
	if err != nil {
		return err
	}
	var layerPaths []string
	for _, l := range layers {
		h, err := l.Digest()
		if err != nil {
			return err
		}
		rc, err := l.Compressed()
		if err != nil {
			return err
		}
		data, err := io.ReadAll(rc)
		rc.Close()
		if err != nil {
			return err
		}
		layerPaths = append(layerPaths, addBlob(h, data))
	}
	index, err := json.Marshal(v1.IndexManifest{
		SchemaVersion: 2,
		MediaType:     types.OCIImageIndex,
		Manifests: []v1.Descriptor{{
			MediaType:   types.OCIManifestSchema1,
			Digest:      digest,
			Size:        int64(len(manifest)),
			Annotations: map[string]string{annotationContainerdName: name, annotationRefName: name},
		}},
	})
	if err != nil {
		return err
	}
	docker, err := json.Marshal([]struct {
		Config   string
		RepoTags []string
		Layers   []string
	}{{Config: configPath, RepoTags: []string{name}, Layers: layerPaths}})
	if err != nil {
		return err
	}

	tw := tar.NewWriter(w)
	dir := func(name string) error {
		return tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: name, Mode: 0o755, ModTime: epoch, Format: tar.FormatPAX})
	}
	file := func(name string, data []byte) error {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: 0o644, Size: int64(len(data)), ModTime: epoch, Format: tar.FormatPAX}); err != nil {
			return err
		}
		_, err := tw.Write(data)
		return err
	}
	if err := dir("blobs/"); err != nil {
		return err
	}
	if err := dir("blobs/sha256/"); err != nil {
		return err
	}
	paths := make([]string, 0, len(blobs))
	for p := range blobs {
		paths = append(paths, p)
	}
	sort.Strings(paths)
	for _, p := range paths {
		if err := file(p, blobs[p]); err != nil {
			return fmt.Errorf("archive %s: %w", p, err)
		}
	}
	for _, f := range []struct {
		name string
		data []byte
	}{
		{"oci-layout", []byte(`{"imageLayoutVersion":"1.0.0"}`)},
		{"index.json", index},
		{"manifest.json", docker},
	} {
		if err := file(f.name, f.data); err != nil {
			return err
		}
	}
	return tw.Close()
}
