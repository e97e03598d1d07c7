{{/* Chart name, overridable with nameOverride. */}}
{{- define "pagoda.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified app name (63 characters at most: a DNS label). A release already named after the
chart (e.g. `helm install pagoda charts/pagoda`) is not repeated: "pagoda", not "pagoda-pagoda".
*/}}
{{- define "pagoda.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Chart name and version, for the helm.sh/chart label. */}}
{{- define "pagoda.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels that never change for the life of a release: safe in Deployment selectors. */}}
{{- define "pagoda.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pagoda.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Standard labels for every object of the chart. */}}
{{- define "pagoda.labels" -}}
helm.sh/chart: {{ include "pagoda.chart" . }}
{{ include "pagoda.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pagoda
{{- end }}

{{/* The ServiceAccount the operator runs as (created by the chart or brought by the user). */}}
{{- define "pagoda.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pagoda.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* image reference: repository:tag, the tag defaulting to the chart's appVersion. */}}
{{- define "pagoda.image" -}}
{{- printf "%s:%s" .repository (default .appVersion .tag) }}
{{- end }}

{{/* The operator's container image. */}}
{{- define "pagoda.operatorImage" -}}
{{- include "pagoda.image" (dict "repository" .Values.operator.image.repository "tag" .Values.operator.image.tag "appVersion" .Chart.AppVersion) }}
{{- end }}

{{/* The serving image the operator puts in InferenceService pods (env PAGODA_SERVER_IMAGE). */}}
{{- define "pagoda.serverImage" -}}
{{- include "pagoda.image" (dict "repository" .Values.server.image.repository "tag" .Values.server.image.tag "appVersion" .Chart.AppVersion) }}
{{- end }}
