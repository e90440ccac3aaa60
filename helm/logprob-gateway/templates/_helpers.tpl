{{- define "logprob-gateway.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "logprob-gateway.fullname" -}}
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

{{/* Names of the other objects: the fullname shortened so that the suffix still fits in 63. */}}
{{- define "logprob-gateway.redisName" -}}
{{- printf "%s-redis" (include "logprob-gateway.fullname" . | trunc 57 | trimSuffix "-") }}
{{- end }}

{{- define "logprob-gateway.authSecretName" -}}
{{- default (printf "%s-auth" (include "logprob-gateway.fullname" . | trunc 58 | trimSuffix "-")) .Values.auth.existingSecret }}
{{- end }}

{{- define "logprob-gateway.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "logprob-gateway.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Pod templates add these to their selector labels; other objects use "labels". */}}
{{- define "logprob-gateway.commonLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "logprob-gateway.labels" -}}
{{ include "logprob-gateway.commonLabels" . }}
app.kubernetes.io/name: {{ include "logprob-gateway.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Gateway and Redis pods share name and instance, so the component tells them apart. */}}
{{- define "logprob-gateway.selectorLabels" -}}
app.kubernetes.io/name: {{ include "logprob-gateway.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: gateway
{{- end }}

{{- define "logprob-gateway.redisSelectorLabels" -}}
app.kubernetes.io/name: {{ include "logprob-gateway.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: redis
{{- end }}

{{- define "logprob-gateway.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/*
The gateway's config file. Top-level scalars first, then each table ([cache], [limits]) and each
array of tables ([[models]]); values nested deeper become inline tables and arrays.
*/}}
{{- define "logprob-gateway.configToml" -}}
{{- $config := .Values.config }}
{{- range $key := keys $config | sortAlpha }}
{{- $value := get $config $key }}
{{- if not (or (kindIs "map" $value) (kindIs "slice" $value) (kindIs "invalid" $value)) }}
{{ include "logprob-gateway.tomlKey" $key }} = {{ include "logprob-gateway.tomlValue" $value }}
{{- end }}
{{- end }}
{{- range $key := keys $config | sortAlpha }}
{{- $value := get $config $key }}
{{- if kindIs "map" $value }}

[{{ include "logprob-gateway.tomlKey" $key }}]
{{- include "logprob-gateway.tomlPairs" $value }}
{{- else if kindIs "slice" $value }}
{{- range $table := $value }}

[[{{ include "logprob-gateway.tomlKey" $key }}]]
{{- include "logprob-gateway.tomlPairs" $table }}
{{- end }}
{{- end }}
{{- end }}
{{ end }}

{{/* `key = value` lines of a table; null values are left out (the gateway's default applies). */}}
{{- define "logprob-gateway.tomlPairs" -}}
{{- range $key := keys . | sortAlpha }}
{{- $value := get $ $key }}
{{- if not (kindIs "invalid" $value) }}
{{ include "logprob-gateway.tomlKey" $key }} = {{ include "logprob-gateway.tomlValue" $value }}
{{- end }}
{{- end }}
{{- end }}

{{- define "logprob-gateway.tomlKey" -}}
{{- if regexMatch "^[A-Za-z0-9_-]+$" . }}{{ . }}{{ else }}{{ toJson . }}{{ end }}
{{- end }}

{{/*
A TOML value. JSON strings are valid TOML basic strings. Helm reads every YAML number as a
float, so integral numbers are written as integers: the gateway and the engines need ints, and
Go would print a float such as 2**26 as 6.7108864e+07.
*/}}
{{- define "logprob-gateway.tomlValue" -}}
{{- if kindIs "string" . }}{{ toJson . }}
{{- else if kindIs "bool" . }}{{ . }}
{{- else if kindIs "float64" . }}{{ if eq . (floor .) }}{{ int64 . }}{{ else }}{{ . }}{{ end }}
{{- else if or (kindIs "int" .) (kindIs "int64" .) }}{{ . }}
{{- else if kindIs "slice" . }}[{{ range $i, $item := . }}{{ if $i }}, {{ end }}{{ include "logprob-gateway.tomlValue" $item }}{{ end }}]
{{- else if kindIs "map" . }}{{ "{" }}{{ range $i, $key := keys . | sortAlpha }}{{ if $i }}, {{ end }}{{ include "logprob-gateway.tomlKey" $key }} = {{ include "logprob-gateway.tomlValue" (get $ $key) }}{{ end }}{{ "}" }}
{{- else }}{{ fail (printf "config: %v cannot be written as TOML" .) }}
{{- end }}
{{- end }}

{{/* A read-only volume for models or adapters: a PVC or a node directory; nothing for "none". */}}
{{- define "logprob-gateway.storageVolume" -}}
{{- if eq .storage.source "pvc" -}}
- name: {{ .name }}
  persistentVolumeClaim:
    claimName: {{ .storage.claimName }}
    readOnly: true
{{- else if eq .storage.source "hostPath" -}}
- name: {{ .name }}
  hostPath:
    path: {{ .storage.hostPath }}
    type: Directory
{{- end }}
{{- end }}

{{- define "logprob-gateway.routerName" -}}
{{- printf "%s-router" (include "logprob-gateway.fullname" . | trunc 56 | trimSuffix "-") }}
{{- end }}

{{- define "logprob-gateway.routerSelectorLabels" -}}
app.kubernetes.io/name: {{ include "logprob-gateway.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: router
{{- end }}
