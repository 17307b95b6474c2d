{{/*
A control-plane Deployment (valora-cpu image) and its Service. Call with
(dict "ctx" $ "component" "gateway" "values" .Values.gateway "module" "services.gateway"
      "secretKeys" (list ...) "mountModel" false "strategy" "RollingUpdate")
*/}}
{{- define "valora.cpuComponent" -}}
{{- $ctx := .ctx -}}
{{- $v := .values -}}
{{- $name := printf "%s-%s" (include "valora.fullname" $ctx) .component -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $name }}
  labels:
    {{- include "valora.labels" (dict "ctx" $ctx "component" .component) | nindent 4 }}
spec:
  replicas: {{ $v.replicas }}
  strategy:
    type: {{ .strategy | default "RollingUpdate" }}
  selector:
    matchLabels:
      {{- include "valora.selectorLabels" (dict "ctx" $ctx "component" .component) | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "valora.labels" (dict "ctx" $ctx "component" .component) | nindent 8 }}
      annotations:
        checksum/config: {{ include (print $ctx.Template.BasePath "/configmap.yaml") $ctx | sha256sum }}
        checksum/secret: {{ include (print $ctx.Template.BasePath "/secret.yaml") $ctx | sha256sum }}
        {{- include "valora.metricsAnnotations" (list $ctx $v.metricsPort) | nindent 8 }}
    spec:
      {{- with $ctx.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- toYaml $ctx.Values.podSecurityContext | nindent 8 }}
      terminationGracePeriodSeconds: {{ add (int $ctx.Values.config.graceS) 10 }}
      containers:
        - name: {{ .component }}
          image: {{ include "valora.cpuImage" $ctx }}
          imagePullPolicy: {{ $ctx.Values.image.cpu.pullPolicy }}
          command: ["python", "-m", {{ .module | quote }}]
          securityContext:
            {{- toYaml $ctx.Values.containerSecurityContext | nindent 12 }}
            readOnlyRootFilesystem: true
          envFrom:
            - configMapRef:
                name: {{ $name }}
          {{- with .secretKeys }}
          env:
            {{- range . }}
            {{- include "valora.secretEnv" (list $ctx .) | nindent 12 }}
            {{- end }}
          {{- end }}
          ports:
            - name: grpc
              containerPort: {{ $v.port }}
              protocol: TCP
            - name: metrics
              containerPort: {{ $v.metricsPort }}
              protocol: TCP
            {{- with $v.httpPort }}
            - name: http
              containerPort: {{ . }}
              protocol: TCP
            {{- end }}
          startupProbe:
            grpc:
              port: {{ $v.port }}
            periodSeconds: 5
            failureThreshold: 60
          readinessProbe:
            grpc:
              port: {{ $v.port }}
            periodSeconds: 10
            timeoutSeconds: 5
            failureThreshold: 3
          livenessProbe:
            grpc:
              port: {{ $v.port }}
            periodSeconds: 20
            timeoutSeconds: 5
            failureThreshold: 3
          resources:
            {{- toYaml $v.resources | nindent 12 }}
          volumeMounts:
            - name: tmp
              mountPath: /tmp
            {{- if .mountModel }}
            {{- include "valora.modelMount" $ctx | nindent 12 }}
            {{- end }}
      volumes:
        - name: tmp
          emptyDir: {}
        {{- if .mountModel }}
        {{- include "valora.modelVolume" $ctx | nindent 8 }}
        {{- end }}
      {{- with $v.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
---
apiVersion: v1
kind: Service
metadata:
  name: {{ $name }}
  labels:
    {{- include "valora.labels" (dict "ctx" $ctx "component" .component) | nindent 4 }}
  {{- with (($v.service | default dict).annotations) }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  type: {{ (($v.service | default dict).type) | default "ClusterIP" }}
  selector:
    {{- include "valora.selectorLabels" (dict "ctx" $ctx "component" .component) | nindent 4 }}
  ports:
    - name: grpc
      port: {{ (($v.service | default dict).port) | default $v.port }}
      targetPort: grpc
      protocol: TCP
      appProtocol: grpc
    - name: metrics
      port: {{ $v.metricsPort }}
      targetPort: metrics
      protocol: TCP
    {{- with $v.httpPort }}
    - name: http
      port: {{ . }}
      targetPort: http
      protocol: TCP
    {{- end }}
{{- end -}}
