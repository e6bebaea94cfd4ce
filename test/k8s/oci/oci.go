// Package oci writes container images as OCI image-layout archives, the
// format `ctr images import` reads, with no registry involved: the k8s
// end-to-end test has no network, so the node's images (the pod sandbox
// "pause" image and a busybox image for test pods) are written on the host
// and imported on the node before kubelet starts.
//
// Every image shares one layer: a statically linked busybox and a symlink
// per applet. Images differ only in their config (entrypoint, command).
// Output is deterministic: fixed timestamps, sorted entries.
package oci

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sort"
	"strings"
	"time"
)

// Media types of the OCI image spec.
const (
	MediaTypeIndex    = "application/vnd.oci.image.index.v1+json"
	MediaTypeManifest = "application/vnd.oci.image.manifest.v1+json"
	MediaTypeConfig   = "application/vnd.oci.image.config.v1+json"
	MediaTypeLayer    = "application/vnd.oci.image.layer.v1.tar+gzip"
	// AnnotationImageName is the name containerd gives an imported image.
	AnnotationImageName = "io.containerd.image.name"
	annotationRefName   = "org.opencontainers.image.ref.name"
)

// Image is one image of an archive.
type Image struct {
	Name       string // full reference, e.g. localhost/pause:1
	Entrypoint []string
	Cmd        []string
	Env        []string // default PATH=/bin:/sbin
}

// PauseCommand is a sandbox process that exits at SIGTERM at once (a shell
// ignoring SIGTERM as PID 1 would hold every shutdown for the full stop
// timeout).
var PauseCommand = []string{"/bin/sh", "-c", `trap "exit 0" TERM INT; while :; do sleep 3600 & wait $!; done`}

// Descriptor of a blob.
type Descriptor struct {
	MediaType   string            `json:"mediaType"`
	Digest      string            `json:"digest"`
	Size        int64             `json:"size"`
	Annotations map[string]string `json:"annotations,omitempty"`
}

type blob struct {
	desc Descriptor
	data []byte
}

func newBlob(mediaType string, data []byte) blob {
	sum := sha256.Sum256(data)
	return blob{desc: Descriptor{MediaType: mediaType, Digest: "sha256:" + hex.EncodeToString(sum[:]), Size: int64(len(data))}, data: data}
}

// epoch is the timestamp of every file and image: output depends only on
// the inputs.
var epoch = time.Unix(0, 0).UTC()

// BusyboxLayer returns the gzip layer (a tar of bin/busybox and one symlink
// per applet under bin/, plus the directories a container runtime mounts
// over) and the digest of its uncompressed tar (the diff ID).
func BusyboxLayer(busybox []byte, applets []string) (layer []byte, diffID string, err error) {
	if len(busybox) == 0 {
		return nil, "", errors.New("oci: empty busybox binary")
	}
	var tarBuf bytes.Buffer
	tw := tar.NewWriter(&tarBuf)
	for _, d := range []string{"bin/", "dev/", "etc/", "proc/", "sys/", "tmp/", "var/", "data/"} {
		mode := int64(0o755)
		if d == "tmp/" {
			mode = 0o1777
		}
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: d, Mode: mode, ModTime: epoch, Format: tar.FormatPAX}); err != nil {
			return nil, "", err
		}
	}
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: "bin/busybox", Mode: 0o755, Size: int64(len(busybox)), ModTime: epoch, Format: tar.FormatPAX}); err != nil {
		return nil, "", err
	}
	if _, err := tw.Write(busybox); err != nil {
		return nil, "", err
	}
	seen := map[string]bool{"busybox": true}
	names := append([]string(nil), applets...)
	sort.Strings(names)
	for _, a := range names {
		a = strings.TrimSpace(a)
		if a == "" || seen[a] || strings.ContainsAny(a, "/ ") {
			continue
		}
		seen[a] = true
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeSymlink, Name: "bin/" + a, Linkname: "busybox", Mode: 0o777, ModTime: epoch, Format: tar.FormatPAX}); err != nil {
			return nil, "", err
		}
	}
	// /sbin too, for programs that look there.
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeSymlink, Name: "sbin", Linkname: "bin", Mode: 0o777, ModTime: epoch, Format: tar.FormatPAX}); err != nil {
		return nil, "", err
	}
	if err := tw.Close(); err != nil {
		return nil, "", err
	}
	sum := sha256.Sum256(tarBuf.Bytes())
	var gz bytes.Buffer
	zw, err := gzip.NewWriterLevel(&gz, gzip.BestCompression)
	if err != nil {
		return nil, "", err
	}
	zw.ModTime = epoch
	if _, err := zw.Write(tarBuf.Bytes()); err != nil {
		return nil, "", err
	}
	if err := zw.Close(); err != nil {
		return nil, "", err
	}
	return gz.Bytes(), "sha256:" + hex.EncodeToString(sum[:]), nil
}

// WriteArchive writes an OCI image layout as a tar stream holding images,
// all on the busybox layer.
func WriteArchive(w io.Writer, busybox []byte, applets []string, images []Image) error {
	if len(images) == 0 {
		return errors.New("oci: no images")
	}
	layerData, diffID, err := BusyboxLayer(busybox, applets)
	if err != nil {
		return err
	}
	layer := newBlob(MediaTypeLayer, layerData)
	blobs := []blob{layer}
	var manifests []Descriptor
	for _, img := range images {
		if img.Name == "" || !strings.Contains(img.Name, ":") {
			return fmt.Errorf("oci: image name %q needs a tag", img.Name)
		}
		env := img.Env
		if len(env) == 0 {
			env = []string{"PATH=/bin:/sbin"}
		}
		cfg := map[string]any{
			"created":      epoch.Format(time.RFC3339),
			"architecture": "amd64",
			"os":           "linux",
			"config": map[string]any{
				"Env":        env,
				"Entrypoint": img.Entrypoint,
				"Cmd":        img.Cmd,
				"WorkingDir": "/",
			},
			"rootfs":  map[string]any{"type": "layers", "diff_ids": []string{diffID}},
			"history": []map[string]any{{"created": epoch.Format(time.RFC3339), "created_by": "sparsevol test/k8s/oci"}},
		}
		cfgData, err := json.Marshal(cfg)
		if err != nil {
			return err
		}
		config := newBlob(MediaTypeConfig, cfgData)
		man := map[string]any{
			"schemaVersion": 2,
			"mediaType":     MediaTypeManifest,
			"config":        config.desc,
			"layers":        []Descriptor{layer.desc},
		}
		manData, err := json.Marshal(man)
		if err != nil {
			return err
		}
		manifest := newBlob(MediaTypeManifest, manData)
		blobs = append(blobs, config, manifest)
		d := manifest.desc
		d.Annotations = map[string]string{
			AnnotationImageName: img.Name,
			annotationRefName:   img.Name[strings.LastIndex(img.Name, ":")+1:],
		}
		manifests = append(manifests, d)
	}
	index, err := json.Marshal(map[string]any{
		"schemaVersion": 2,
		"mediaType":     MediaTypeIndex,
		"manifests":     manifests,
	})
	if err != nil {
		return err
	}

	return writeLayout(w, blobs, index)
}

// writeLayout writes an OCI image layout (oci-layout, blobs, index.json)
// as a tar stream.
func writeLayout(w io.Writer, blobs []blob, index []byte) error {
	tw := tar.NewWriter(w)
	file := func(name string, data []byte) error {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: 0o644, Size: int64(len(data)), ModTime: epoch}); err != nil {
			return err
		}
		_, err := tw.Write(data)
		return err
	}
	for _, d := range []string{"blobs/", "blobs/sha256/"} {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: d, Mode: 0o755, ModTime: epoch}); err != nil {
			return err
		}
	}
	if err := file("oci-layout", []byte(`{"imageLayoutVersion":"1.0.0"}`)); err != nil {
		return err
	}
	written := map[string]bool{}
	for _, b := range blobs {
		if written[b.desc.Digest] {
			continue
		}
		written[b.desc.Digest] = true
		if err := file("blobs/sha256/"+strings.TrimPrefix(b.desc.Digest, "sha256:"), b.data); err != nil {
			return err
		}
	}
	if err := file("index.json", index); err != nil {
		return err
	}
	return tw.Close()
}

// Binary is an image of one static program and nothing else (a CSI
// sidecar built from its Go module): /Path is its entrypoint.
type Binary struct {
	Name string // full reference, e.g. localhost/csi-provisioner:v6.4.0
	Path string // in the image, e.g. csi-provisioner
	Data []byte
}

// WriteBinaries writes an OCI image layout as a tar stream holding one
// single-layer image per program (the program and an empty /tmp).
func WriteBinaries(w io.Writer, images []Binary) error {
	if len(images) == 0 {
		return errors.New("oci: no images")
	}
	var blobs []blob
	var manifests []Descriptor
	for _, img := range images {
		if img.Name == "" || !strings.Contains(img.Name, ":") || img.Path == "" || strings.Contains(img.Path, "/") || len(img.Data) == 0 {
			return fmt.Errorf("oci: image %q of %q: want a tagged name, a file name and the program", img.Name, img.Path)
		}
		var tarBuf bytes.Buffer
		tw := tar.NewWriter(&tarBuf)
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: "tmp/", Mode: 0o1777, ModTime: epoch, Format: tar.FormatPAX}); err != nil {
			return err
		}
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: img.Path, Mode: 0o755, Size: int64(len(img.Data)), ModTime: epoch, Format: tar.FormatPAX}); err != nil {
			return err
		}
		if _, err := tw.Write(img.Data); err != nil {
			return err
		}
		if err := tw.Close(); err != nil {
			return err
		}
		sum := sha256.Sum256(tarBuf.Bytes())
		var gz bytes.Buffer
		zw := gzip.NewWriter(&gz)
		zw.ModTime = epoch
		if _, err := zw.Write(tarBuf.Bytes()); err != nil {
			return err
		}
		if err := zw.Close(); err != nil {
			return err
		}
		layer := newBlob(MediaTypeLayer, gz.Bytes())
		cfgData, err := json.Marshal(map[string]any{
			"created": epoch.Format(time.RFC3339), "architecture": "amd64", "os": "linux",
			"config":  map[string]any{"Entrypoint": []string{"/" + img.Path}, "WorkingDir": "/"},
			"rootfs":  map[string]any{"type": "layers", "diff_ids": []string{"sha256:" + hex.EncodeToString(sum[:])}},
			"history": []map[string]any{{"created": epoch.Format(time.RFC3339), "created_by": "sparsevol test/k8s/oci"}},
		})
		if err != nil {
			return err
		}
		config := newBlob(MediaTypeConfig, cfgData)
		manData, err := json.Marshal(map[string]any{
			"schemaVersion": 2, "mediaType": MediaTypeManifest, "config": config.desc, "layers": []Descriptor{layer.desc},
		})
		if err != nil {
			return err
		}
		manifest := newBlob(MediaTypeManifest, manData)
		blobs = append(blobs, layer, config, manifest)
		d := manifest.desc
		d.Annotations = map[string]string{
			AnnotationImageName: img.Name,
			annotationRefName:   img.Name[strings.LastIndex(img.Name, ":")+1:],
		}
		manifests = append(manifests, d)
	}
	index, err := json.Marshal(map[string]any{"schemaVersion": 2, "mediaType": MediaTypeIndex, "manifests": manifests})
	if err != nil {
		return err
	}
	return writeLayout(w, blobs, index)
}
