"""The chart's DRA parts (helm/gpunode/templates/dra-*.yaml): DeviceClasses and the agent's rights on
ResourceSlices, rendered by a real helm. The real API server validates the same DeviceClasses and the
scheduler uses them in tests/e2e/test_dra_slices.py."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes.client import ApiClient

from gpunode.contract import dra as names
from tests.deploy.test_helm_chart import FULLNAME, needs_helm, render, run_helm

ON = {"config": {"gpunode": {"dra": {"enabled": True}}}}


def typed_class(doc: dict[str, Any]) -> Any:
    api = ApiClient()
    model = api._ApiClient__deserialize(dict(doc), "V1DeviceClass")  # type: ignore[attr-defined]
    return api.sanitize_for_serialization(model)


@needs_helm
def test_dra_off_renders_nothing_of_it() -> None:
    out = render({})
    assert not out.kinds("DeviceClass")
    assert all(d["metadata"]["name"] != f"{FULLNAME}-agent-dra" for d in out.docs)


@needs_helm
def test_dra_on_renders_four_classes_selecting_by_driver_and_sharing() -> None:
    out = render(ON)
    classes = {d["metadata"]["name"]: d for d in out.kinds("DeviceClass")}
    assert sorted(classes) == sorted(
        [names.CLASS_WHOLE, names.CLASS_SHARED, names.CLASS_MIG, names.CLASS_TIME_SLICED]
    )
    for name, sharing in (
        (names.CLASS_WHOLE, names.SHARING_WHOLE),
        (names.CLASS_SHARED, names.SHARING_SHARED),
        (names.CLASS_MIG, names.SHARING_MIG),
        (names.CLASS_TIME_SLICED, names.SHARING_TIME_SLICED),
    ):
        doc = classes[name]
        assert typed_class(doc) == doc
        assert doc["spec"]["selectors"] == [
            {
                "cel": {
                    "expression": f'device.driver == "{names.DEFAULT_DRIVER}" && '
                    f'device.attributes["{names.DEFAULT_DRIVER}"].{names.ATTR_SHARING} == "{sharing}"'
                }
            }
        ]
    assert classes[names.CLASS_WHOLE]["spec"]["extendedResourceName"] == "nvidia.com/gpu"
    assert "extendedResourceName" not in classes[names.CLASS_SHARED]["spec"]


@needs_helm
def test_driver_name_and_extended_resource_follow_the_values() -> None:
    out = render(
        {
            "config": {"gpunode": {"dra": {"enabled": True, "driverName": "gpu.example.com"}}},
            "dra": {"extendedResourceName": ""},
        }
    )
    whole = out.named("DeviceClass", names.CLASS_WHOLE)
    assert 'device.driver == "gpu.example.com"' in whole["spec"]["selectors"][0]["cel"]["expression"]
    assert "extendedResourceName" not in whole["spec"]
    assert not render({**ON, "dra": {"deviceClasses": False}}).kinds("DeviceClass")


@needs_helm
def test_the_agent_may_write_resourceslices_and_read_its_node() -> None:
    out = render(ON)
    role = out.named("ClusterRole", f"{FULLNAME}-agent-dra")
    rules = {(tuple(r["apiGroups"]), tuple(r["resources"])): set(r["verbs"]) for r in role["rules"]}
    assert rules[(("resource.k8s.io",), ("resourceslices",))] == {
        "get",
        "list",
        "watch",
        "create",
        "update",
        "delete",
    }
    assert rules[(("",), ("nodes",))] == {"get"}
    binding = out.named("ClusterRoleBinding", f"{FULLNAME}-agent-dra")
    assert binding["subjects"][0]["name"] == f"{FULLNAME}-agent"
    assert not any(
        d["metadata"]["name"].endswith("-agent-dra") for d in render({**ON, "rbac": {"create": False}}).docs
    )


@needs_helm
@pytest.mark.parametrize("bad", ["nvidia.com/", "not a name", "/gpu"])
def test_a_malformed_extended_resource_name_fails_the_schema(bad: str) -> None:
    proc = run_helm("template", "gn", values={**ON, "dra": {"extendedResourceName": bad}})
    assert proc.returncode != 0 and "extendedResourceName" in proc.stderr, proc.stderr


@needs_helm
def test_the_toleration_policy_is_rendered_bound_and_exempts_the_listed_namespaces() -> None:
    out = render({**ON, "dra": {"tolerationExemptNamespaces": ["ops"]}})
    policy = out.named("ValidatingAdmissionPolicy", f"{FULLNAME}-dra-tolerations")
    rules = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rules[0]["resources"] == ["resourceclaims", "resourceclaimtemplates"]
    assert policy["spec"]["matchConstraints"]["matchPolicy"] == "Equivalent"
    assert policy["spec"]["matchConditions"] == [
        {"name": "not-exempt", "expression": '!(request.namespace in ["ops"])'}
    ]
    assert names.TAINT_KEY in policy["spec"]["validations"][0]["expression"]
    binding = out.named("ValidatingAdmissionPolicyBinding", f"{FULLNAME}-dra-tolerations")
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    assert (
        "matchConditions"
        not in render(ON).named("ValidatingAdmissionPolicy", f"{FULLNAME}-dra-tolerations")["spec"]
    )
    assert not render({**ON, "dra": {"refuseUnhealthyTolerations": False}}).kinds("ValidatingAdmissionPolicy")


@needs_helm
def test_an_exempt_namespace_must_be_a_namespace_name() -> None:
    proc = run_helm(
        "template", "gn", values={**ON, "dra": {"tolerationExemptNamespaces": ['x"]) || true || (["']}}
    )
    assert proc.returncode != 0 and "tolerationExemptNamespaces" in proc.stderr, proc.stderr
