{{/*
Names, labels, the agent's rendered configuration and its RBAC rules.

The agent's configuration is .Values.config with the settings the chart owns filled in (host
paths, metrics listen address, driver root); a value that contradicts the chart's mounts, probes
or Service makes rendering fail with the key, what it should be and how to fix it.
*/}}

{{- define "gpunode.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "gpunode.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The name of one part: <fullname>-<part> (agent, extender, metrics, ...). */}}
{{- define "gpunode.partName" -}}
{{- printf "%s-%s" (include "gpunode.fullname" .root) .part | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "gpunode.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "gpunode.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: gpunode
{{- end }}

{{/* Selector labels of one part; call with (dict "root" $ "part" "agent"). */}}
{{- define "gpunode.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpunode.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .part }}
{{- end }}

{{- define "gpunode.partLabels" -}}
{{ include "gpunode.labels" .root }}
app.kubernetes.io/component: {{ .part }}
{{- end }}

{{- define "gpunode.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "gpunode.agentServiceAccount" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "gpunode.partName" (dict "root" . "part" "agent")) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* A number from values (YAML numbers arrive as float64) or a string, as plain text. */}}
{{- define "gpunode.text" -}}
{{- if kindIs "float64" . }}{{ int64 . }}{{ else }}{{ . }}{{ end }}
{{- end }}

{{/*
The agent's configuration document as YAML: .Values.config with kubeletDir, stateDir,
podResourcesSocket, metrics.listen and flags.nvidiaDriverRoot filled in from the chart's values.
*/}}
{{- define "gpunode.agentConfig" -}}
{{- $cfg := deepCopy .Values.config }}
{{- $own := default (dict) (get $cfg "gpunode") }}
{{- $_ := set $cfg "gpunode" $own }}
{{- $paths := .Values.agent.hostPaths }}
{{- $owned := list
  (list "kubeletDir" (clean $paths.devicePlugins) "agent.hostPaths.devicePlugins")
  (list "stateDir" (clean $paths.state) "agent.hostPaths.state")
  (list "podResourcesSocket" (printf "%s/kubelet.sock" (clean $paths.podResources)) "agent.hostPaths.podResources") }}
{{- range $owned }}
{{- $key := index . 0 }}
{{- $want := index . 1 }}
{{- if and (hasKey $own $key) (ne (clean (toString (get $own $key))) $want) }}
{{- fail (printf "config.gpunode.%s is %v, but the chart mounts the host's %s (from %s) at that path. HINT: leave config.gpunode.%s out and set %s instead" $key (get $own $key) $want (index . 2) $key (index . 2)) }}
{{- end }}
{{- $_ := set $own $key $want }}
{{- end }}
{{- if hasKey $own "nodeName" }}
{{- fail "config.gpunode.nodeName is set, but every agent of the DaemonSet must annotate its own Node. HINT: leave it out: the chart gives each agent its node's name in NODE_NAME" }}
{{- end }}
{{- $metrics := default (dict) (get $own "metrics") }}
{{- $_ := set $own "metrics" $metrics }}
{{- if eq (toString (get $metrics "enabled")) "false" }}
{{- fail "config.gpunode.metrics.enabled is false, but the agent's probes and metrics Service use its metrics endpoint. HINT: keep the endpoint on (leave metricsService.enabled false to publish no Service)" }}
{{- end }}
{{- $port := include "gpunode.text" .Values.agent.metricsPort }}
{{- if hasKey $metrics "listen" }}
{{- $listen := toString (get $metrics "listen") }}
{{- $host := regexReplaceAll ":[0-9]+$" $listen "" }}
{{- $given := trimPrefix ":" (regexFind ":[0-9]+$" $listen) }}
{{- if not (has $host (list "" "0.0.0.0" "[::]")) }}
{{- fail (printf "config.gpunode.metrics.listen is %s: the kubelet's probes and Prometheus reach the agent on its pod IP, not on %s. HINT: use :%s" $listen $host $port) }}
{{- end }}
{{- if ne $given $port }}
{{- fail (printf "config.gpunode.metrics.listen is %s, but agent.metricsPort is %s. HINT: leave config.gpunode.metrics.listen out and set agent.metricsPort" $listen $port) }}
{{- end }}
{{- else }}
{{- $_ := set $metrics "listen" (printf ":%s" $port) }}
{{- end }}
{{- $flags := default (dict) (get $cfg "flags") }}
{{- $root := get $flags "nvidiaDriverRoot" }}
{{- if .Values.agent.driverRoot }}
{{- if and $root (ne (clean (toString $root)) (clean .Values.agent.driverRoot)) }}
{{- fail (printf "config.flags.nvidiaDriverRoot is %v, but agent.driverRoot is %s. HINT: leave config.flags.nvidiaDriverRoot out and set agent.driverRoot" $root .Values.agent.driverRoot) }}
{{- end }}
{{- $_ := set $flags "nvidiaDriverRoot" (clean .Values.agent.driverRoot) }}
{{- $_ := set $cfg "flags" $flags }}
{{- else if and $root (ne (clean (toString $root)) "/") }}
{{- fail (printf "config.flags.nvidiaDriverRoot is %v, but the chart mounts no driver root. HINT: set agent.driverRoot to %v instead, so the driver is mounted and NVML is loaded from it" $root $root) }}
{{- end }}
{{- $rem := default (dict) (get $own "remediation") }}
{{- if and (eq (toString (get $rem "mode")) "baremetal") (not .Values.agent.hostPID) }}
{{- fail "config.gpunode.remediation.mode is baremetal, which signals the processes on a failed GPU by their host PIDs, but agent.hostPID is false. HINT: set agent.hostPID: true, or use remediation.mode kubernetes (evict the pods)" }}
{{- end }}
{{- toYaml $cfg }}
{{- end }}

{{/*
The agent's ClusterRole rules (YAML list, empty when it needs no API access), from what the
configuration turns on: see docs/health.md (RBAC) and gpunode/publish.py.
  pods get              remediation on Kubernetes: the UID of a pod to evict
  pods/eviction create  remediation on Kubernetes, not dry-run
  pods delete           remediation.deleteAfterDeadline, not dry-run
  events create         remediation.postEvents (dry-run Events too)
  nodes patch           the gpunode.io/gpu-state annotation (nodeState.enabled) and the
                        gpunode.io/unhealthy-gpus annotation (remediation.markNode, not dry-run)
  pods get, patch and   idle.enabled: read and set gpunode.io/gpu-idle-since on pods whose GPUs
  events create         stay idle, post their GPUIdle Event (gpunode/node/idle.py)
*/}}
{{- define "gpunode.agentRules" -}}
{{- $own := default (dict) (get .Values.config "gpunode") }}
{{- $rem := default (dict) (get $own "remediation") }}
{{- $nodeState := default (dict) (get $own "nodeState") }}
{{- $kube := eq (toString (default "kubernetes" (get $rem "mode"))) "kubernetes" }}
{{- $dry := eq (toString (get $rem "dryRun")) "true" }}
{{- $events := ne (toString (get $rem "postEvents")) "false" }}
{{- $markNode := ne (toString (get $rem "markNode")) "false" }}
{{- $delete := eq (toString (get $rem "deleteAfterDeadline")) "true" }}
{{- $publish := ne (toString (get $nodeState "enabled")) "false" }}
{{- $idle := eq (toString (get (default (dict) (get $own "idle")) "enabled")) "true" }}
{{- if $kube }}
- apiGroups: [""]
  resources: ["pods"]
  verbs: {{ if and $delete (not $dry) }}["get", "delete"]{{ else }}["get"]{{ end }}
{{- if not $dry }}
- apiGroups: [""]
  resources: ["pods/eviction"]
  verbs: ["create"]
{{- end }}
{{- if $events }}
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end }}
{{- end }}
{{- if or $publish (and $kube (not $dry) $markNode) }}
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["patch"]
{{- end }}
{{- if $publish }}
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch", "patch"]
{{- end }}
{{- if $idle }}
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "patch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end }}
{{- end }}

{{/* The fractional resource name and unit the agent advertises (for the extender). */}}
{{- define "gpunode.fractionalResource" -}}
{{- $frac := default (dict) (get (default (dict) (get .Values.config "gpunode")) "fractional") }}
{{- default "gpunode.io/gpu-memory" (get $frac "resourceName") }}
{{- end }}

{{- define "gpunode.fractionalUnit" -}}
{{- $frac := default (dict) (get (default (dict) (get .Values.config "gpunode")) "fractional") }}
{{- include "gpunode.text" (default "1Gi" (get $frac "unit")) }}
{{- end }}

{{- define "gpunode.extenderServiceAccount" -}}
{{- include "gpunode.partName" (dict "root" . "part" "extender") }}
{{- end }}

{{/* Whether the extender talks to the API server (binding, node lists, leader election). */}}
{{- define "gpunode.extenderNeedsApi" -}}
{{- if or .Values.extender.bind .Values.extender.nodeCacheCapable .Values.extender.ha.enabled .Values.extender.provisionalReservations }}true{{ end }}
{{- end }}
