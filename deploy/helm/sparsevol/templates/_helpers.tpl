{{/* The labels every object carries (the same as deploy/kubernetes). */}}
{{- define "sparsevol.labels" -}}
app.kubernetes.io/name: sparsevol
{{- end }}

{{/* The CSI driver's name: the binary's default, and the CSIDriver's. */}}
{{- define "sparsevol.driver" -}}
sparsevol.csi.io
{{- end }}

{{/* The CSI socket's directory on the host. */}}
{{- define "sparsevol.socketDir" -}}
{{ .Values.kubeletDir }}/plugins/{{ include "sparsevol.driver" . }}
{{- end }}

{{/*
Fails the render where storeDir is, or is under, a path the plugin
container mounts or runs from (kubeletDir, /csi, /dev, the /host mounts,
the udev rule's directory, the image's system directories), or holds
kubeletDir: the pod would get one path mounted twice, or the store would
hide the container's binary or tools.
*/}}
{{- define "sparsevol.checkStoreDir" -}}
{{- $store := .Values.storeDir }}
{{- range $taken := list .Values.kubeletDir "/csi" "/dev" "/host" "/run/sparsevol/udev" "/usr" "/bin" "/sbin" "/lib" "/lib64" "/etc" "/proc" "/sys" }}
{{- if or (eq $store $taken) (hasPrefix (printf "%s/" $taken) $store) }}
{{- fail (printf "storeDir %s is %s or under it, which the plugin container mounts or runs from: give the store a directory of its own, e.g. /var/lib/sparsevol" $store $taken) }}
{{- end }}
{{- end }}
{{- if hasPrefix (printf "%s/" $store) .Values.kubeletDir }}
{{- fail (printf "kubeletDir %s is under storeDir %s: give the store a directory of its own, e.g. /var/lib/sparsevol" .Values.kubeletDir $store) }}
{{- end }}
{{- end }}
