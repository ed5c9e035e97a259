{{/* Chart name, or nameOverride; 63 characters at most (a DNS label). */}}
{{- define "outbox.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name of the release's resources: fullnameOverride, else the release name when it
already contains the chart name, else "<release>-<chart>".
*/}}
{{- define "outbox.fullname" -}}
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

{{/* "<fullname>-<suffix>", still a valid 63-character name. */}}
{{- define "outbox.suffixedName" -}}
{{- $root := index . 0 }}
{{- $suffix := index . 1 }}
{{- printf "%s-%s" (include "outbox.fullname" $root | trunc (int (sub 62 (len $suffix))) | trimSuffix "-") $suffix }}
{{- end }}

{{- define "outbox.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Selector of the server pods. The component label keeps the migration Job's pod out of
the Service, the PodDisruptionBudget and the Deployment.
*/}}
{{- define "outbox.selectorLabels" -}}
app.kubernetes.io/name: {{ include "outbox.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: server
{{- end }}

{{/* Labels of every server-side resource. */}}
{{- define "outbox.labels" -}}
helm.sh/chart: {{ include "outbox.chart" . }}
{{ include "outbox.selectorLabels" . }}
app.kubernetes.io/version: {{ include "outbox.tag" . | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: outboxd
{{- end }}

{{/* Labels of the migration Job and its pod: deliberately not the server's selector. */}}
{{- define "outbox.migrateLabels" -}}
helm.sh/chart: {{ include "outbox.chart" . }}
app.kubernetes.io/name: {{ include "outbox.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: migrate
app.kubernetes.io/version: {{ include "outbox.tag" . | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: outboxd
{{- end }}

{{/* Labels of another Job and its pod: (list $ "<component>"), not the server's selector. */}}
{{- define "outbox.jobLabels" -}}
{{- $root := index . 0 }}
helm.sh/chart: {{ include "outbox.chart" $root }}
app.kubernetes.io/name: {{ include "outbox.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
app.kubernetes.io/version: {{ include "outbox.tag" $root | quote }}
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
app.kubernetes.io/part-of: outboxd
{{- end }}

{{/* Image tag: image.tag, else the chart's appVersion. */}}
{{- define "outbox.tag" -}}
{{- .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/*
Image reference. A digest pins the image ("repo@sha256:…", or "repo:tag@sha256:…" when a
tag is also given, for readability); a malformed digest fails the render even when the
schema is skipped (--skip-schema-validation), because a typo would otherwise surface
only as an ImagePullBackOff.
*/}}
{{- define "outbox.image" -}}
{{- $digest := .Values.image.digest | default "" }}
{{- if $digest }}
{{- if not (regexMatch "^sha256:[a-f0-9]{64}$" $digest) }}
{{- fail (printf "image.digest %q is malformed: expected sha256: followed by 64 lowercase hex digits" $digest) }}
{{- end }}
{{- if .Values.image.tag }}
{{- printf "%s:%s@%s" .Values.image.repository .Values.image.tag $digest }}
{{- else }}
{{- printf "%s@%s" .Values.image.repository $digest }}
{{- end }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (include "outbox.tag" .) }}
{{- end }}
{{- end }}

{{/* ServiceAccount of the server pods. */}}
{{- define "outbox.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "outbox.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Secret holding the PostgreSQL URL (never created by the chart). */}}
{{- define "outbox.databaseSecretName" -}}
{{- .Values.database.existingSecret | default (include "outbox.suffixedName" (list . "database")) }}
{{- end }}

{{/* Secret holding the fleet role's URL (never created by the chart). */}}
{{- define "outbox.fleetSecretName" -}}
{{- .Values.database.fleet.existingSecret | default (include "outbox.suffixedName" (list . "database-fleet")) }}
{{- end }}

{{/* Secret holding the schema owner's URL (never created by the chart). */}}
{{- define "outbox.migrationSecretName" -}}
{{- .Values.database.migration.existingSecret | default (include "outbox.suffixedName" (list . "database-owner")) }}
{{- end }}

{{/* Secret holding the client CA (mTLS): its own, else the server certificate's. */}}
{{- define "outbox.clientCASecretName" -}}
{{- .Values.tls.clientCA.existingSecret | default .Values.tls.existingSecret }}
{{- end }}

{{/* Fails early on combinations the binary could not run with. */}}
{{- define "outbox.validate" -}}
{{- if and .Values.tls.enabled (not .Values.tls.existingSecret) }}
{{- fail "tls.enabled needs tls.existingSecret (a kubernetes.io/tls Secret, e.g. from cert-manager)" }}
{{- end }}
{{- if and (not .Values.database.migration.enabled) (ne .Values.migrations.mode "none") }}
{{- fail "migrations.mode hook or initContainer needs database.migration.enabled (they run as the schema owner); to migrate out of band, set migrations.mode: none with database.migration.enabled: false" }}
{{- end }}
{{- if and .Values.tls.clientCA.enabled (not .Values.tls.enabled) }}
{{- fail "tls.clientCA.enabled needs tls.enabled" }}
{{- end }}
{{- if not (or .Values.tls.enabled .Values.tls.allowPlaintext) }}
{{- fail "outboxd serves plaintext off loopback only when told to: set tls.enabled (with tls.existingSecret) or tls.allowPlaintext" }}
{{- end }}
{{- /* The kubelet sends SIGTERM only once preStop has returned, within the same grace period. */}}
{{- $preStop := include "outbox.preStopSeconds" . | float64 }}
{{- $needed := addf $preStop .Values.shutdown.drainDelaySeconds .Values.shutdown.graceSeconds }}
{{- if le (float64 .Values.terminationGracePeriodSeconds) $needed }}
{{- fail (printf "terminationGracePeriodSeconds must exceed the preStop sleep (lifecycle.preStop) + shutdown.drainDelaySeconds + shutdown.graceSeconds (here %v + %v + %v = %v s), or the kubelet kills outboxd mid-drain" $preStop (int .Values.shutdown.drainDelaySeconds) (int .Values.shutdown.graceSeconds) $needed) }}
{{- end }}
{{- if and .Values.serviceMonitor.enabled (not .Values.metrics.enabled) }}
{{- fail "serviceMonitor.enabled needs metrics.enabled (there is nothing to scrape otherwise)" }}
{{- end }}
{{- if and .Values.metrics.enabled (eq (int .Values.metrics.port) (int .Values.containerPort)) }}
{{- fail "metrics.port must differ from containerPort" }}
{{- end }}
{{- if and .Values.console.enabled (eq (int .Values.console.port) (int .Values.containerPort)) }}
{{- fail "console.port must differ from containerPort" }}
{{- end }}
{{- if and .Values.console.enabled .Values.metrics.enabled (eq (int .Values.console.port) (int .Values.metrics.port)) }}
{{- fail "console.port must differ from metrics.port" }}
{{- end }}
{{- end }}

{{/*
Seconds lifecycle.preStop holds the container before the kubelet sends SIGTERM, where it
can be known: the `sleep` action (seconds), or `sleep N[s|m|h]` in an exec command (as its
argv, or in a `sh -c` script; several sleeps add up). Other hooks (httpGet, another
command) count as 0: their duration is unknowable here, see terminationGracePeriodSeconds
in values.yaml. Note that the image has no shell and no `sleep` binary: only the action
works in the outboxd container.
*/}}
{{- define "outbox.preStopSeconds" -}}
{{- $total := 0.0 }}
{{- $preStop := (.Values.lifecycle | default dict).preStop | default dict }}
{{- with $preStop.sleep }}
{{- $total = addf $total (.seconds | default 0) }}
{{- end }}
{{- with $preStop.exec }}
{{- $command := join " " (.command | default list) }}
{{- range regexFindAll "(^|[\\s/;&|(])sleep\\s+[0-9]+(\\.[0-9]+)?[smh]?($|[\\s;&|)])" $command -1 }}
{{- $arg := regexFind "[0-9]+(\\.[0-9]+)?[smh]?($|[\\s;&|)])" . | trimAll " ;&|)" }}
{{- $unit := get (dict "s" 1 "m" 60 "h" 3600) (regexFind "[smh]$" $arg) | default 1 }}
{{- $total = addf $total (mulf (regexFind "^[0-9]+(\\.[0-9]+)?" $arg) $unit) }}
{{- end }}
{{- end }}
{{- $total }}
{{- end }}

{{/*
Metadata of a pod template: podAnnotations and podLabels (every pod of the chart), a Job's
own podAnnotations and podLabels over them, and the chart's labels over all (they hold
the selectors, which keep Job pods out of the Service; the schema refuses them in
podLabels anyway). Call with (list $ "<the chart's labels as YAML>" <a Job's values, or dict>).
*/}}
{{- define "outbox.podMetadata" -}}
{{- $root := index . 0 }}
{{- $own := index . 2 }}
{{- $annotations := merge (dict) ($own.podAnnotations | default dict) ($root.Values.podAnnotations | default dict) }}
{{- $labels := merge (fromYaml (index . 1)) ($own.podLabels | default dict) ($root.Values.podLabels | default dict) }}
{{- with $annotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
labels:
  {{- toYaml $labels | nindent 2 }}
{{- end }}

{{/*
Topology spread of the server pods: topologySpreadConstraints, plus defaultTopologySpread
(over the server's own pods) unless a constraint of its topologyKey is already there.
*/}}
{{- define "outbox.topologySpreadConstraints" -}}
{{- $constraints := .Values.topologySpreadConstraints | default list }}
{{- with .Values.defaultTopologySpread }}
{{- $keys := list }}
{{- range $constraints }}
{{- $keys = append $keys .topologyKey }}
{{- end }}
{{- if and .enabled (not (has .topologyKey $keys)) }}
{{- $constraints = append $constraints (dict
      "maxSkew" .maxSkew
      "topologyKey" .topologyKey
      "whenUnsatisfiable" .whenUnsatisfiable
      "labelSelector" (dict "matchLabels" (include "outbox.selectorLabels" $ | fromYaml))) }}
{{- end }}
{{- end }}
{{- with $constraints }}
{{- toYaml . }}
{{- end }}
{{- end }}

{{/*
Environment of every outboxd container (server, init and hook migrations): one
configuration, so `outboxd migrate` accepts exactly what `outboxd serve` accepts.
outboxd refuses to start on an unknown OUTBOX_* variable, so only set what it reads.
Call with (dict "root" $ "migrate" true|false).
*/}}
{{- define "outbox.env" -}}
{{- $root := .root }}
{{- with $root -}}
- name: OUTBOX_LISTEN_ADDR
  value: {{ printf "%s:%d" .Values.listenHost (int .Values.containerPort) | quote }}
- name: OUTBOX_DATABASE__URL
  valueFrom:
    secretKeyRef:
      name: {{ include "outbox.databaseSecretName" . }}
      key: {{ .Values.database.existingSecretKey }}
- name: OUTBOX_DATABASE__FLEET_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "outbox.fleetSecretName" . }}
      key: {{ .Values.database.fleet.existingSecretKey }}
{{- /* The owner's URL goes where migrations run: the migration containers, or the server itself with mode none. */}}
{{- if and .Values.database.migration.enabled (or $.migrate (eq .Values.migrations.mode "none")) }}
- name: OUTBOX_DATABASE__MIGRATION_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "outbox.migrationSecretName" . }}
      key: {{ .Values.database.migration.existingSecretKey }}
{{- end }}
{{- if not (kindIs "invalid" .Values.database.maxConnections) }}
- name: OUTBOX_DATABASE__MAX_CONNECTIONS
  value: {{ include "outboxd.envValue" .Values.database.maxConnections | quote }}
{{- end }}
- name: OUTBOX_LOG__FORMAT
  value: {{ .Values.log.format | quote }}
{{- with .Values.log.filter }}
- name: OUTBOX_LOG__FILTER
  value: {{ . | quote }}
{{- end }}
{{- if .Values.tls.enabled }}
- name: OUTBOX_TLS__CERT_FILE
  value: {{ printf "%s/%s" (trimSuffix "/" .Values.tls.mountPath) .Values.tls.certKey | quote }}
- name: OUTBOX_TLS__KEY_FILE
  value: {{ printf "%s/%s" (trimSuffix "/" .Values.tls.mountPath) .Values.tls.keyKey | quote }}
{{- if .Values.tls.clientCA.enabled }}
- name: OUTBOX_TLS__CLIENT_CA_FILE
  value: {{ printf "%s/%s" (trimSuffix "/" .Values.tls.clientCA.mountPath) .Values.tls.clientCA.key | quote }}
{{- end }}
{{- else if .Values.tls.allowPlaintext }}
- name: OUTBOX_ALLOW_PLAINTEXT
  value: "true"
{{- end }}
- name: OUTBOX_METRICS__LISTEN_ADDR
  value: {{ ternary (printf "%s:%d" .Values.listenHost (int .Values.metrics.port)) "" .Values.metrics.enabled | quote }}
{{- /* Unset, not empty, when off: outboxd serves no console by default. */}}
{{- if .Values.console.enabled }}
- name: OUTBOX_CONSOLE__LISTEN_ADDR
  value: {{ printf "%s:%d" .Values.listenHost (int .Values.console.port) | quote }}
{{- end }}
- name: OUTBOX_SHUTDOWN__DRAIN_DELAY
  value: {{ printf "%ds" (int .Values.shutdown.drainDelaySeconds) | quote }}
- name: OUTBOX_SHUTDOWN__GRACE
  value: {{ printf "%ds" (int .Values.shutdown.graceSeconds) | quote }}
{{- range .Values.env }}
- name: {{ .name }}
  value: {{ include "outboxd.envValue" .value | quote }}
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}
{{- end }}

{{/* Mounts of every outboxd container: a writable /tmp, TLS material, extras. */}}
{{- define "outbox.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: {{ .Values.tls.mountPath }}
  readOnly: true
{{- if .Values.tls.clientCA.enabled }}
- name: tls-client-ca
  mountPath: {{ .Values.tls.clientCA.mountPath }}
  readOnly: true
{{- end }}
{{- end }}
{{- with .Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Volumes backing outbox.volumeMounts. */}}
{{- define "outbox.volumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.tmpSizeLimit }}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ .Values.tls.existingSecret }}
    defaultMode: 0440
    items:
      - key: {{ .Values.tls.certKey }}
        path: {{ .Values.tls.certKey }}
      - key: {{ .Values.tls.keyKey }}
        path: {{ .Values.tls.keyKey }}
{{- if .Values.tls.clientCA.enabled }}
- name: tls-client-ca
  secret:
    secretName: {{ include "outbox.clientCASecretName" . }}
    defaultMode: 0440
    items:
      - key: {{ .Values.tls.clientCA.key }}
        path: {{ .Values.tls.clientCA.key }}
{{- end }}
{{- end }}
{{- with .Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The `outboxd migrate` container, for the init container and the hook Job alike. */}}
{{- define "outbox.migrateContainer" -}}
- name: migrate
  image: {{ include "outbox.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  args: ["migrate"]
  env:
    {{- include "outbox.env" (dict "root" . "migrate" true) | nindent 4 }}
  {{- with .Values.migrations.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    {{- include "outbox.volumeMounts" . | nindent 4 }}
{{- end }}

{{/*
A probe: HTTP on the admin port (`metrics`, plain HTTP whatever the gRPC port's TLS), whose
/readyz reflects a drain and an unusable database, with or without TLS. With metrics off
there is no admin port: kubelet's gRPC probe, or a TCP connect with TLS (kubelet's gRPC
probe speaks plaintext only), which sees neither. Liveness and startup without a service
connect over TCP: the whole server's gRPC health turns NOT_SERVING while the database is
unusable, which a restart would not cure.
*/}}
{{- define "outbox.probe" -}}
{{- $root := index . 0 }}
{{- $probe := index . 1 }}
{{- $alive := eq (index . 2) "alive" }}
{{- if $root.Values.metrics.enabled }}
httpGet:
  path: {{ $probe.path }}
  port: metrics
{{- else if or $root.Values.tls.enabled (and $alive (not $probe.service)) }}
tcpSocket:
  port: grpc
{{- else }}
grpc:
  port: {{ $root.Values.containerPort }}
  {{- with $probe.service }}
  service: {{ . | quote }}
  {{- end }}
{{- end }}
{{- toYaml (omit $probe "enabled" "service" "path") | nindent 0 }}
{{- end }}

{{/*
An env value as text. YAML numbers reach templates as float64, which toString writes in
scientific notation from 1e6 on ("1.6777216e+07"), a value outboxd refuses: a whole
number is written as an integer.
*/}}
{{- define "outboxd.envValue" -}}
{{- if and (kindIs "float64" .) (eq (floor .) .) -}}
{{- int64 . -}}
{{- else -}}
{{- toString . -}}
{{- end -}}
{{- end }}
