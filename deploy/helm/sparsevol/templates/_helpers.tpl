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
