{{/*
One webhook entry of the MutatingWebhookConfiguration <fullname>-queue-webhook (queue-gate.yaml), all
but its selector; call with (dict "name" <Service> "namespace" <ns> "caBundle" <base64 PEM> "g" .Values.queue.gate).
Pod creations only: the gate can be added at creation and never after.
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
