{{/* The release's full name: "<release>-bij-operator", or the release name when it already says so. */}}
{{- define "bij-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "bij-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "bij-operator.labels" -}}
{{ include "bij-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: bij
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "bij-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "bij-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "bij-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "bij-operator.workerImage" -}}
{{- printf "%s:%s" .Values.workerImage.repository (default .Chart.AppVersion .Values.workerImage.tag) -}}
{{- end -}}

{{- define "bij-operator.stepsImage" -}}
{{- if .Values.stepsImage.repository -}}
{{- printf "%s:%s" .Values.stepsImage.repository (default .Chart.AppVersion .Values.stepsImage.tag) -}}
{{- else -}}
{{- include "bij-operator.image" . -}}
{{- end -}}
{{- end -}}

{{/* Namespaces the operator watches when not cluster-wide, as a JSON list. */}}
{{- define "bij-operator.watchNamespaces" -}}
{{- if .Values.watch.namespaces -}}
{{- .Values.watch.namespaces | uniq | toJson -}}
{{- else -}}
{{- list .Release.Namespace | toJson -}}
{{- end -}}
{{- end -}}

{{/* Namespaces that get the bij-worker service account, as a JSON list: where round Jobs run. */}}
{{- define "bij-operator.workerNamespaces" -}}
{{- $namespaces := list -}}
{{- if .Values.watch.allNamespaces -}}
{{- $namespaces = list .Release.Namespace -}}
{{- else -}}
{{- $namespaces = include "bij-operator.watchNamespaces" . | fromJsonArray -}}
{{- end -}}
{{- concat $namespaces .Values.workerServiceAccount.namespaces | uniq | toJson -}}
{{- end -}}

{{/*
The operator's permissions: the one list. Rules for objects that live in the namespaces of the
BatchInferenceJobs go in a Role per watched namespace, or in the ClusterRole when cluster-wide;
cluster-scoped objects always go in the ClusterRole.
*/}}
{{- define "bij-operator.rules.namespaced" -}}
# The jobs themselves: kopf watches them and patches its progress annotations.
- apiGroups: [batchinference.io]
  resources: [batchinferencejobs]
  verbs: [get, list, watch, patch]
- apiGroups: [batchinference.io]
  resources: [batchinferencejobs/status]
  verbs: [patch]
# Round Jobs are created with an ownerReference with blockOwnerDeletion, which clusters running
# the OwnerReferencesPermissionEnforcement admission plugin allow only with this permission.
- apiGroups: [batchinference.io]
  resources: [batchinferencejobs/finalizers]
  verbs: [update]
# One Indexed Job per round, one per publish pass, one per storage step: created, watched, patched
# (suspend, parallelism); a step Job that met a passing failure is deleted to run it again. Deleting
# a BatchInferenceJob deletes its Jobs through owner references, not through the operator.
- apiGroups: [batch]
  resources: [jobs]
  verbs: [get, list, watch, create, patch, delete]
# A bij whose lanes span several pods (spec.workers.nodesPerLane): one headless Service, so that a lane's
# pods find its leader by name; deleted with the bij through its owner reference.
- apiGroups: [""]
  resources: [services]
  verbs: [create]
# The failed pods of a step Job: their exit code, reason (OOMKilled) and last log lines say why a
# step is retried or failed (listed only once a step's pod failed).
- apiGroups: [""]
  resources: [pods]
  verbs: [list]
# A running round's lanes report their progress into a Lease each (bij.worker.report); the operator sums
# them, a page at a time, at a fixed rate.
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  verbs: [list]
# Events on the BatchInferenceJobs (kopf posts core v1 events).
- apiGroups: [""]
  resources: [events]
  verbs: [create]
# spec.notify: the key that signs a bij's webhook POSTs, from the Secret its secretRef names (read once a
# bij ends and names one; never listed or watched, and no other key is read).
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
# Before a bij's first pod: does its worker service account hold every grant its pods use? Asked with a
# LocalSubjectAccessReview in the bij's namespace (namespaced: a Role grants it; nothing else is read).
- apiGroups: [authorization.k8s.io]
  resources: [localsubjectaccessreviews]
  verbs: [create]
{{- if and .Values.peering.enabled (not .Values.watch.allNamespaces) }}
# kopf peering in namespaced mode: one KopfPeering per watched namespace.
- apiGroups: [kopf.dev]
  resources: [kopfpeerings]
  verbs: [list, watch, patch]
{{- end }}
{{- end -}}

{{- define "bij-operator.rules.worker" -}}
# A step pod: a merge patch of its own key under status.reports of its bij (bij.worker.report).
- apiGroups: [batchinference.io]
  resources: [batchinferencejobs/status]
  verbs: [patch]
# A lane's pod: its progress in a Lease of its own, made on its first report and patched after.
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  verbs: [create]
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  verbs: [patch]
{{- end -}}

{{- define "bij-operator.rules.cluster" -}}
{{- if .Values.watch.allNamespaces }}
# Cluster-wide, kopf finds the resources it serves by scanning CRDs. With exact namespaces
# the operator turns scanning off and needs no cluster-scoped permission at all.
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
{{- if .Values.peering.enabled }}
# kopf peering in cluster-wide mode: one ClusterKopfPeering.
- apiGroups: [kopf.dev]
  resources: [clusterkopfpeerings]
  verbs: [list, watch, patch]
{{- end }}
{{- end }}
{{- end -}}

{{/*
bij-api's permissions, audited like the operator's: check a caller's token (TokenReview) and its
right to create BatchInferenceJobs in its namespace (SubjectAccessReview), then create, read,
list and cancel (patch spec.cancel) the bij of each batch. It never deletes one, and reads no
Secret: storage access is its own identity's (the files prefix).
*/}}
{{- define "bij-operator.rules.api" -}}
- apiGroups: [authentication.k8s.io]
  resources: [tokenreviews]
  verbs: [create]
- apiGroups: [authorization.k8s.io]
  resources: [subjectaccessreviews]
  verbs: [create]
- apiGroups: [batchinference.io]
  resources: [batchinferencejobs]
  verbs: [get, list, create, patch]
{{- end -}}
