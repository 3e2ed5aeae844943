{{/* Chart name. */}}
{{- define "mergepipe.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name: <release>-<chart> unless the release name already contains the chart name. */}}
{{- define "mergepipe.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "mergepipe.selectorLabels" -}}
app.kubernetes.io/name: {{ include "mergepipe.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "mergepipe.labels" -}}
{{ include "mergepipe.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: mergepipe
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end -}}

{{- define "mergepipe.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "mergepipe.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/*
An image reference: repository@digest when a digest is set (pinned: the tag is ignored), else
repository:tag (the tag defaulting to the chart's appVersion).
*/}}
{{- define "mergepipe.image" -}}
{{- if .digest -}}
{{- printf "%s@%s" .repository .digest -}}
{{- else -}}
{{- printf "%s:%s" .repository (default .appVersion .tag) -}}
{{- end -}}
{{- end -}}

{{/*
gc.grace in seconds (3600, 90m, 24h, 7d, 1.5h; the values schema checks the form).
*/}}
{{- define "mergepipe.graceSeconds" -}}
{{- $g := toString . -}}
{{- $unit := regexFind "[smhd]$" $g -}}
{{- $n := float64 (trimSuffix $unit $g) -}}
{{- $mult := get (dict "" 1 "s" 1 "m" 60 "h" 3600 "d" 86400) $unit -}}
{{- mulf $n $mult -}}
{{- end -}}

{{/*
RBAC rules for the watched namespaces: exactly the calls the operator makes
(mergepipe_operator/k8s/api.py) plus what kopf needs (watch, patch for finalizers and its
annotations, events).
*/}}
{{- define "mergepipe.namespacedRules" -}}
- apiGroups: ["mergepipe.io"]
  resources: ["modelmerges", "mergedsnapshots", "mergequotas", "mergesearches"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["mergepipe.io"]
  resources: ["mergedsnapshots"]
  verbs: ["create"]
- apiGroups: ["mergepipe.io"]
  resources: ["modelmerges/status", "mergedsnapshots/status", "mergesearches/status"]
  verbs: ["get", "patch"]
- apiGroups: ["mergepipe.io"]
  resources: ["mergequotas/status"]
  verbs: ["get", "update"]
# the Jobs' ownerReferences block their owner's deletion (blockOwnerDeletion): clusters enforcing
# OwnerReferencesPermissionEnforcement allow that only with update on the owner's finalizers
- apiGroups: ["mergepipe.io"]
  resources: ["modelmerges/finalizers", "mergesearches/finalizers"]
  verbs: ["update"]
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "create", "delete"]
# a failed Job's cause: its pod's termination message (read only; no logs, no exec)
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list"]
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create"]
{{- if and (gt (int .Values.replicas) 1) .Values.watchNamespaces }}
# kopf peering of the replicas (one KopfPeering per watched namespace)
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}
{{- if .Values.kueue.admissionCheck.enabled }}
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["localqueues"]
  verbs: ["get"]
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads/status"]
  verbs: ["get", "update"]
{{- end }}
{{- end -}}


{{/*
What a MergeSearch's driver may do in its namespace: create its candidates (ModelMerges) and their
evaluation Jobs, follow them (MergedSnapshots read). Nothing else: no Pods, no Secrets, no status
writes. No user code runs in the driver's pod (the evaluator command runs in the evaluation Jobs,
which get no token).
*/}}
{{- define "mergepipe.searchDriverRules" -}}
- apiGroups: ["mergepipe.io"]
  resources: ["modelmerges"]
  verbs: ["create", "get", "list", "watch"]
- apiGroups: ["mergepipe.io"]
  resources: ["mergedsnapshots"]
  verbs: ["get", "list"]
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["create", "get", "list", "watch", "delete"]
# its candidates and evaluation Jobs are owned by the MergeSearch with blockOwnerDeletion
- apiGroups: ["mergepipe.io"]
  resources: ["mergesearches/finalizers"]
  verbs: ["update"]
{{- end -}}

{{/*
NetworkPolicy egress rules: TCP to each {cidr, port} of a list; DNS to the cluster DNS pods.
*/}}
{{- define "mergepipe.egressTo" -}}
{{- range . }}
- to:
    - ipBlock:
        cidr: {{ .cidr | quote }}
  ports:
    - protocol: TCP
      port: {{ .port | int }}
{{- end }}
{{- end -}}
{{- define "mergepipe.dnsEgress" -}}
- to:
    - namespaceSelector: {}
      podSelector:
        matchLabels:
          {{- toYaml .podLabels | nindent 10 }}
  ports:
    - protocol: UDP
      port: 53
    - protocol: TCP
      port: 53
{{- end -}}
