{{/*
One webhook entry of the MutatingWebhookConfiguration <fullname>-queue-webhook (queue-gate.yaml), all
but its selector; call with (dict "name" <Service> "namespace" <ns> "caBundle" <base64 PEM> "g" .Values.queue.gate).
Pod creations (the gate can be added at creation and never after), and Job and JobSet creations (a
governed one is created suspended, its pod templates labelled with its queue).
*/}}
{{- define "gpunode.queueGateHook" -}}
admissionReviewVersions: ["v1"]
sideEffects: None
failurePolicy: {{ .g.failurePolicy }}
timeoutSeconds: {{ .g.timeoutSeconds }}
matchPolicy: Equivalent
reinvocationPolicy: IfNeeded
rules:
  - apiGroups: [""]
    apiVersions: ["v1"]
    operations: ["CREATE"]
    resources: ["pods"]
    scope: Namespaced
  - apiGroups: ["batch"]
    apiVersions: ["v1"]
    operations: ["CREATE"]
    resources: ["jobs"]
    scope: Namespaced
  - apiGroups: ["jobset.x-k8s.io"]
    apiVersions: ["v1alpha2"]
    operations: ["CREATE"]
    resources: ["jobsets"]
    scope: Namespaced
clientConfig:
  service:
    name: {{ .name }}
    namespace: {{ .namespace }}
    path: /mutate-pods
    port: 443
  {{- with .caBundle }}
  caBundle: {{ . }}
  {{- end }}
{{- end }}
