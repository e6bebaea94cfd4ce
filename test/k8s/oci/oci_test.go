package oci

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"io"
	"strings"
	"testing"
)

func readTar(t *testing.T, r io.Reader) map[string][]byte {
	t.Helper()
	files := map[string][]byte{}
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return files
		}
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(tr)
		if h.Typeflag == tar.TypeSymlink {
			b = []byte("-> " + h.Linkname)
		}
		files[h.Name] = b
	}
}

func digest(b []byte) string {
	s := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(s[:])
}

// The archive is a valid OCI image layout: every descriptor points at a blob
// of its digest and size, the layer's diff ID is the digest of its tar, and
// each manifest in index.json carries the name containerd imports it under.
func TestArchiveIsConsistent(t *testing.T) {
	busybox := []byte("\x7fELF fake busybox")
	var buf bytes.Buffer
	images := []Image{
		{Name: "localhost/pause:1", Entrypoint: PauseCommand},
		{Name: "localhost/busybox:1", Cmd: []string{"sh"}},
	}
	if err := WriteArchive(&buf, busybox, []string{"sh", "sleep", "cat", "sh", ""}, images); err != nil {
		t.Fatal(err)
	}
	// Deterministic.
	var again bytes.Buffer
	WriteArchive(&again, busybox, []string{"sh", "sleep", "cat"}, images)
	if !bytes.Equal(buf.Bytes(), again.Bytes()) {
		t.Error("two writes of the same images differ")
	}

	files := readTar(t, &buf)
	if string(files["oci-layout"]) != `{"imageLayoutVersion":"1.0.0"}` {
		t.Errorf("oci-layout = %q", files["oci-layout"])
	}
	blob := func(d Descriptor) []byte {
		t.Helper()
		b, ok := files["blobs/sha256/"+strings.TrimPrefix(d.Digest, "sha256:")]
		if !ok {
			t.Fatalf("blob %s missing", d.Digest)
		}
		if digest(b) != d.Digest || int64(len(b)) != d.Size {
			t.Fatalf("blob %s: digest %s size %d, descriptor says size %d", d.Digest, digest(b), len(b), d.Size)
		}
		return b
	}
	var index struct {
		SchemaVersion int          `json:"schemaVersion"`
		Manifests     []Descriptor `json:"manifests"`
	}
	if err := json.Unmarshal(files["index.json"], &index); err != nil {
		t.Fatal(err)
	}
	if index.SchemaVersion != 2 || len(index.Manifests) != 2 {
		t.Fatalf("index: %s", files["index.json"])
	}
	for i, md := range index.Manifests {
		if md.Annotations[AnnotationImageName] != images[i].Name || md.MediaType != MediaTypeManifest {
			t.Errorf("manifest %d: %+v", i, md)
		}
		var man struct {
			Config Descriptor   `json:"config"`
			Layers []Descriptor `json:"layers"`
		}
		if err := json.Unmarshal(blob(md), &man); err != nil {
			t.Fatal(err)
		}
		var cfg struct {
			Config struct {
				Entrypoint []string `json:"Entrypoint"`
				Cmd        []string `json:"Cmd"`
			} `json:"config"`
			RootFS struct {
				DiffIDs []string `json:"diff_ids"`
			} `json:"rootfs"`
		}
		if err := json.Unmarshal(blob(man.Config), &cfg); err != nil {
			t.Fatal(err)
		}
		if strings.Join(cfg.Config.Entrypoint, " ") != strings.Join(images[i].Entrypoint, " ") {
			t.Errorf("image %d entrypoint %v", i, cfg.Config.Entrypoint)
		}
		if len(man.Layers) != 1 || man.Layers[0].MediaType != MediaTypeLayer {
			t.Fatalf("layers %+v", man.Layers)
		}
		zr, err := gzip.NewReader(bytes.NewReader(blob(man.Layers[0])))
		if err != nil {
			t.Fatal(err)
		}
		raw, _ := io.ReadAll(zr)
		if len(cfg.RootFS.DiffIDs) != 1 || cfg.RootFS.DiffIDs[0] != digest(raw) {
			t.Errorf("diff_ids %v, layer tar digest %s", cfg.RootFS.DiffIDs, digest(raw))
		}
		layer := readTar(t, bytes.NewReader(raw))
		if !bytes.Equal(layer["bin/busybox"], busybox) {
			t.Error("bin/busybox not in the layer")
		}
		for _, a := range []string{"sh", "sleep", "cat"} {
			if string(layer["bin/"+a]) != "-> busybox" {
				t.Errorf("bin/%s = %q", a, layer["bin/"+a])
			}
		}
		if _, ok := layer["tmp/"]; !ok {
			t.Error("no tmp/ in the layer")
		}
	}
}

func TestRejectsBadInput(t *testing.T) {
	if err := WriteArchive(io.Discard, nil, nil, []Image{{Name: "a:1"}}); err == nil {
		t.Error("empty busybox accepted")
	}
	if err := WriteArchive(io.Discard, []byte("x"), nil, []Image{{Name: "untagged"}}); err == nil {
		t.Error("untagged name accepted")
	}
	if err := WriteArchive(io.Discard, []byte("x"), nil, nil); err == nil {
		t.Error("no images accepted")
	}
}

// A program image: one layer with the program (and /tmp), its entrypoint,
// the name containerd imports it under; bad input is refused.
func TestBinaries(t *testing.T) {
	prog := []byte("\x7fELF fake csi-provisioner")
	var buf bytes.Buffer
	if err := WriteBinaries(&buf, []Binary{{Name: "localhost/csi-provisioner:v6.4.0", Path: "csi-provisioner", Data: prog}}); err != nil {
		t.Fatal(err)
	}
	files := readTar(t, &buf)
	var index struct {
		Manifests []Descriptor `json:"manifests"`
	}
	if err := json.Unmarshal(files["index.json"], &index); err != nil || len(index.Manifests) != 1 {
		t.Fatalf("index %s: %v", files["index.json"], err)
	}
	if got := index.Manifests[0].Annotations[AnnotationImageName]; got != "localhost/csi-provisioner:v6.4.0" {
		t.Errorf("image name %q", got)
	}
	blob := func(d Descriptor) []byte {
		t.Helper()
		b := files["blobs/sha256/"+strings.TrimPrefix(d.Digest, "sha256:")]
		if digest(b) != d.Digest {
			t.Fatalf("blob %s missing or wrong", d.Digest)
		}
		return b
	}
	var man struct {
		Config Descriptor   `json:"config"`
		Layers []Descriptor `json:"layers"`
	}
	if err := json.Unmarshal(blob(index.Manifests[0]), &man); err != nil || len(man.Layers) != 1 {
		t.Fatalf("manifest: %v", err)
	}
	var cfg struct {
		Config struct{ Entrypoint []string } `json:"config"`
	}
	if err := json.Unmarshal(blob(man.Config), &cfg); err != nil || strings.Join(cfg.Config.Entrypoint, " ") != "/csi-provisioner" {
		t.Errorf("entrypoint %v (%v)", cfg.Config.Entrypoint, err)
	}
	zr, err := gzip.NewReader(bytes.NewReader(blob(man.Layers[0])))
	if err != nil {
		t.Fatal(err)
	}
	if layer := readTar(t, zr); !bytes.Equal(layer["csi-provisioner"], prog) {
		t.Error("the program is not in the layer")
	}
	for _, bad := range []Binary{{Name: "untagged", Path: "p", Data: prog}, {Name: "a:1", Path: "a/b", Data: prog}, {Name: "a:1", Path: "p"}} {
		if err := WriteBinaries(io.Discard, []Binary{bad}); err == nil {
			t.Errorf("%+v accepted", bad)
		}
	}
}
