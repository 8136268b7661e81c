"""Vertex AI Model Registry: publish registers a promoted model there too, when the spec asks.

One Vertex model per pipeline (model id ``loraflow-{pipeline}``), one model version per version of
the GCS registry (``loraflow.steps.publish``), uploaded with the merged checkpoint's prefix as
its ``artifact_uri`` and the spec's serving container. The GCS registry stays the source of
truth; Vertex mirrors it:

- aliases: the version that is the GCS registry's ``champion`` carries Vertex's ``champion``
  alias and its ``default`` alias (the version used when none is named); Vertex moves an alias
  off the version that held it, so older versions stay registered and only the aliases move
  (``move_champion``: an operator's promote or rollback, loraflow.registry.operations);
- labels link each version back to its run: ``loraflow-pipeline``, ``loraflow-run`` (the run id
  made a label value), ``loraflow-version`` (the GCS registry's version number) and
  ``loraflow-model`` (the start of the merged checkpoint's fingerprint); the full run id and the
  manifest URI are in the version description.

Idempotent: a retried publish finds the version it uploaded (same ``loraflow-version`` and
``loraflow-model`` labels among the model's versions) and only makes sure of its alias; nothing
is uploaded twice.

The SDK (google-cloud-aiplatform's v1 ``ModelServiceClient``, REST transport) is imported when
publishing. ``LORAFLOW_VERTEX_ENDPOINT`` overrides the regional endpoint, as for the Vertex
launcher; an ``http://`` one (the test stand-in) is used with anonymous credentials.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from loraflow.errors import LoraflowError
from loraflow.spec.resource_names import vertex_api_host

CHAMPION = "champion"
DEFAULT = "default"  # Vertex's alias for the version used when none is named
LABEL_PIPELINE = "loraflow-pipeline"
LABEL_RUN = "loraflow-run"
LABEL_VERSION = "loraflow-version"
LABEL_MODEL = "loraflow-model"
UPLOAD_TIMEOUT_S = 1800.0


def label_value(text: str) -> str:
    """``text`` as a Vertex AI label value: lowercase letters, digits, '-' and '_', at most 63."""
    return re.sub(r"[^a-z0-9_-]+", "-", text.lower()).strip("-")[:63]


def model_id(pipeline: str) -> str:
    """The pipeline's Vertex model id (a letter first; lowercase letters, digits, '-', '_'; max 63)."""
    return label_value(f"loraflow-{pipeline}")


@dataclass(frozen=True)
class Target:
    """Where and how to register: the spec's ``publish.vertex_model_registry`` resolved."""

    project: str
    region: str
    display_name: str
    image: str
    args: tuple[str, ...]
    labels: Mapping[str, str]

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], pipeline: str, environ: Mapping[str, str] | None = None) -> Target:
        env = os.environ if environ is None else environ
        project = cfg.get("project") or env.get("LORAFLOW_VERTEX_PROJECT") or env.get("GOOGLE_CLOUD_PROJECT")
        if not project:
            raise LoraflowError(
                "publish.vertex_model_registry needs a project: set publish.vertex_model_registry.project "
                "in the spec, or LORAFLOW_VERTEX_PROJECT / GOOGLE_CLOUD_PROJECT in the workers' environment"
            )
        if not cfg.get("serving_container_image"):
            raise LoraflowError("publish.vertex_model_registry.serving_container_image is required; set it in the spec")
        return cls(
            project=str(project),
            region=str(cfg.get("region") or "us-central1"),
            display_name=str(cfg.get("display_name") or pipeline),
            image=str(cfg["serving_container_image"]),
            args=tuple(cfg.get("serving_container_args") or ()),
            labels=dict(cfg.get("labels") or {}),
        )

    @property
    def parent(self) -> str:
        return f"projects/{self.project}/locations/{self.region}"


def console_url(model_name: str, version_id: str) -> str:
    m = re.fullmatch(r"projects/([^/]+)/locations/([^/]+)/models/([^/@]+)", model_name)
    if not m:
        return ""
    project, region, model = m.groups()
    return (
        f"https://console.cloud.google.com/vertex-ai/models/locations/{region}/models/{model}"
        f"/versions/{version_id}?project={project}"
    )


class VertexModelRegistry:
    """A pipeline's model in Vertex AI Model Registry."""

    def __init__(self, target: Target, pipeline: str, endpoint: str | None = None, credentials: Any = None) -> None:
        self.target = target
        self.pipeline = pipeline
        self.model_name = f"{target.parent}/models/{model_id(pipeline)}"
        self.endpoint = endpoint or os.environ.get("LORAFLOW_VERTEX_ENDPOINT") or vertex_api_host(target.region)
        self.credentials = credentials
        self._client_obj: Any = None

    def _client(self) -> Any:
        if self._client_obj is None:
            from google.api_core.client_options import ClientOptions
            from google.cloud.aiplatform_v1.services.model_service import ModelServiceClient

            credentials = self.credentials
            if credentials is None and self.endpoint.startswith("http://"):
                from google.auth.credentials import AnonymousCredentials

                credentials = AnonymousCredentials()
            self._client_obj = ModelServiceClient(
                credentials=credentials, transport="rest", client_options=ClientOptions(api_endpoint=self.endpoint)
            )
        return self._client_obj

    def versions(self) -> list[Any]:
        """Every version of the pipeline's model (empty when it does not exist yet)."""
        from google.api_core.exceptions import NotFound

        try:
            return list(self._client().list_model_versions(name=self.model_name))
        except NotFound:
            return []

    def publish(
        self,
        *,
        version: int,
        champion: bool,
        artifact_uri: str,
        run_id: str,
        fingerprint: str,
        manifest_uri: str,
        progress: Callable[[str], None] = lambda _: None,
    ) -> dict[str, Any]:
        """Upload GCS registry version ``version`` (unless this run already did) and mirror its alias."""
        labels = self._labels(version, run_id, fingerprint)
        existing = self.versions()
        found = _same_version(existing, labels)
        if found is not None:
            version_id = self._reuse(found, champion, progress)
        else:
            request = self._upload_request(
                version=version,
                champion=champion,
                artifact_uri=artifact_uri,
                run_id=run_id,
                manifest_uri=manifest_uri,
                labels=labels,
                model_exists=bool(existing),
            )
            version_id = self._upload(request, artifact_uri, progress)
        return self._published(version_id)

    def move_champion(self, version: int) -> dict[str, Any]:
        """Give GCS registry version ``version``'s Vertex model version the champion and default aliases
        (an operator's promote or rollback; Vertex moves them off the version that held them)."""
        found = [v for v in self.versions() if v.labels.get(LABEL_VERSION) == str(version)]
        if not found:
            raise LoraflowError(
                f"Vertex AI model {self.model_name} has no version labelled {LABEL_VERSION}={version}, so its "
                f"{CHAMPION} alias cannot mirror the GCS registry's: register it there first (publish does, "
                "for versions promoted while publish.vertex_model_registry was set)"
            )
        version_id = str(found[-1].version_id)
        self._client().merge_version_aliases(
            name=f"{self.model_name}@{version_id}", version_aliases=[CHAMPION, DEFAULT]
        )
        return self._published(version_id)

    def _labels(self, version: int, run_id: str, fingerprint: str) -> dict[str, str]:
        """The target's labels and loraflow's: which pipeline, run, registry version and model."""
        return {
            **self.target.labels,
            LABEL_PIPELINE: label_value(self.pipeline),
            LABEL_RUN: label_value(run_id),
            LABEL_VERSION: str(version),
            LABEL_MODEL: label_value(fingerprint)[:16],
        }

    def _reuse(self, found: Any, champion: bool, progress: Callable[[str], None]) -> str:
        """A version this run uploaded before: give it the champion alias if it should have it now."""
        version_id = str(found.version_id)
        progress(f"Vertex AI model {self.model_name} already has this model as version {version_id}; reusing it")
        if champion and not {CHAMPION, DEFAULT} <= set(found.version_aliases):
            self._client().merge_version_aliases(
                name=f"{self.model_name}@{version_id}", version_aliases=[CHAMPION, DEFAULT]
            )
        return version_id

    def _upload_request(
        self,
        *,
        version: int,
        champion: bool,
        artifact_uri: str,
        run_id: str,
        manifest_uri: str,
        labels: dict[str, str],
        model_exists: bool,
    ) -> Any:
        """A new version of the pipeline's model (the model itself when it does not exist yet)."""
        from google.cloud.aiplatform_v1 import types

        model = types.Model(
            display_name=self.target.display_name,
            description=f"LoRA fine-tunes of the {self.pipeline} loraflow pipeline",
            version_description=f"loraflow registry version {version}, run {run_id}, model {manifest_uri}",
            version_aliases=[CHAMPION, DEFAULT] if champion else [],
            artifact_uri=artifact_uri,
            container_spec=types.ModelContainerSpec(image_uri=self.target.image, args=list(self.target.args)),
            labels=labels,
        )
        return types.UploadModelRequest(
            parent=self.target.parent,
            model=model,
            **({"parent_model": self.model_name} if model_exists else {"model_id": model_id(self.pipeline)}),
        )

    def _upload(self, request: Any, artifact_uri: str, progress: Callable[[str], None]) -> str:
        progress(f"uploading to Vertex AI Model Registry as {self.model_name} (artifacts {artifact_uri})")
        operation = self._client().upload_model(request=request)
        response = operation.result(timeout=UPLOAD_TIMEOUT_S)
        version_id = str(response.model_version_id)
        progress(f"Vertex AI model version {response.model}@{version_id} registered")
        return version_id

    def _published(self, version_id: str) -> dict[str, Any]:
        """What the registry now holds for ``version_id``, read back."""
        current = self._client().get_model(name=f"{self.model_name}@{version_id}")
        return {
            "model": self.model_name,
            "version_id": version_id,
            "version_aliases": sorted(current.version_aliases),
            "labels": dict(current.labels),
            "artifact_uri": current.artifact_uri,
            "console_url": console_url(self.model_name, version_id),
        }


def _same_version(versions: list[Any], labels: dict[str, str]) -> Any | None:
    """The first of ``versions`` labelled with the same registry version and model as ``labels``."""
    return next(
        (
            v
            for v in versions
            if v.labels.get(LABEL_VERSION) == labels[LABEL_VERSION] and v.labels.get(LABEL_MODEL) == labels[LABEL_MODEL]
        ),
        None,
    )
