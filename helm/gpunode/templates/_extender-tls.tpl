{{/*
The extender's TLS: where its certificate comes from, and the checks that keep /bind from being
served to anyone who reaches the port.
*/}}

{{/* The Secret holding the extender's tls.crt, tls.key and ca.crt (the CA of the scheduler's client certificate). */}}
{{- define "gpunode.extenderTlsSecret" -}}
{{- .Values.extender.tls.existingSecret | default (include "gpunode.partName" (dict "root" . "part" "extender-tls")) }}
{{- end }}

{{/* The Secret cert-manager writes the scheduler's client certificate to. */}}
{{- define "gpunode.schedulerClientSecret" -}}
{{- include "gpunode.partName" (dict "root" . "part" "scheduler-client-tls") }}
{{- end }}

{{/* The extender's largest request body: the value, or 4Mi with node names and 32Mi with full Nodes. */}}
{{- define "gpunode.extenderMaxRequest" -}}
{{- $ext := .Values.extender }}
{{- $ext.maxRequestBytes | default (ternary "4Mi" "32Mi" $ext.nodeCacheCapable) }}
{{- end }}

{{/* Fails rendering for TLS values that do not go together, or a bind verb left open. */}}
{{- define "gpunode.extenderTlsCheck" -}}
{{- $ext := .Values.extender }}
{{- $tls := $ext.tls }}
{{- if $tls.enabled }}
{{- if and $tls.existingSecret $tls.certManager.enabled }}
{{- fail "extender.tls.existingSecret and extender.tls.certManager.enabled are both set. HINT: take the certificate from your own Secret or from cert-manager, not both" }}
{{- end }}
{{- else if and $ext.bind (not $ext.insecureBindWithoutTLS) }}
{{- fail "extender.bind is true but extender.tls.enabled is false: anyone who reaches the extender could bind any pod. HINT: enable extender.tls (kube-scheduler then presents a client certificate), or set extender.insecureBindWithoutTLS to accept the risk" }}
{{- end }}
{{- end }}
