//! The deployment files under `deploy/` (Dockerfile, Compose stack,
//! Kubernetes kustomize base) hold together: every YAML file parses (all its
//! documents), the invariants operators rely on hold (probes ask the gRPC
//! health service, nothing runs as root, resources are set, termination
//! outlasts the drain, the Redis URL comes from a Secret), and every retryd
//! configuration shipped there passes the real `retryd check-config`, so a
//! configuration change that breaks deployment fails CI.
//!
//! Nothing here needs Docker or a cluster: the files are read as text.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use retryd::config::{Config, Settings, StoreKind, StoreMode, Urls};
use yaml_rust2::{Yaml, YamlLoader};

/// The service name `retryd health` asks about, and that turns NOT_SERVING
/// when a drain begins.
const HEALTH_SERVICE: &str = "retryd.v1.RetryDecider";

// ---------------------------------------------------------------- helpers

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|err| panic!("{}: {err}", path.display()))
}

/// Every `.yaml` / `.yml` file under `dir`, recursively, sorted.
fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for entry in
            std::fs::read_dir(&dir).unwrap_or_else(|err| panic!("{}: {err}", dir.display()))
        {
            let path = entry.unwrap().path();
            if path.is_dir() {
                pending.push(path);
            } else if matches!(
                path.extension().and_then(|ext| ext.to_str()),
                Some("yaml" | "yml")
            ) {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

/// All documents of a YAML file; empty documents (a trailing `---`) dropped.
fn load(path: &Path) -> Vec<Yaml> {
    let docs = YamlLoader::load_from_str(&read(path))
        .unwrap_or_else(|err| panic!("{}: not valid YAML: {err}", path.display()));
    docs.into_iter().filter(|doc| !doc.is_null()).collect()
}

/// The only document of a single-document file.
fn load_one(path: &Path) -> Yaml {
    let mut docs = load(path);
    assert_eq!(docs.len(), 1, "{}: expected one document", path.display());
    docs.remove(0)
}

/// A scalar as text (YAML may type `5`, `true` or `1.5` where a string is
/// meant), `None` for anything else.
fn scalar(value: &Yaml) -> Option<String> {
    match value {
        Yaml::String(text) | Yaml::Real(text) => Some(text.clone()),
        Yaml::Integer(number) => Some(number.to_string()),
        Yaml::Boolean(flag) => Some(flag.to_string()),
        _ => None,
    }
}

fn text<'a>(value: &'a Yaml, what: &str) -> &'a str {
    value
        .as_str()
        .unwrap_or_else(|| panic!("{what}: expected a string, found {value:?}"))
}

fn seq<'a>(value: &'a Yaml, what: &str) -> &'a [Yaml] {
    value
        .as_vec()
        .unwrap_or_else(|| panic!("{what}: expected a list, found {value:?}"))
}

fn entries(value: &Yaml) -> Vec<(String, &Yaml)> {
    value
        .as_hash()
        .map(|hash| {
            hash.iter()
                .filter_map(|(key, value)| scalar(key).map(|key| (key, value)))
                .collect()
        })
        .unwrap_or_default()
}

/// A list of strings, or one string split on whitespace (Compose and
/// Kubernetes accept both forms for commands).
fn words(value: &Yaml) -> Vec<String> {
    match value {
        Yaml::Array(items) => items.iter().filter_map(scalar).collect(),
        Yaml::String(line) => line.split_whitespace().map(str::to_owned).collect(),
        _ => Vec::new(),
    }
}

/// Whether `command` runs `retryd health` (by any path to the binary).
fn is_retryd_health(command: &[String]) -> bool {
    command.windows(2).any(|pair| {
        Path::new(&pair[0])
            .file_name()
            .and_then(|name| name.to_str())
            == Some("retryd")
            && pair[1] == "health"
    })
}

/// The value of `--addr` in a `retryd health` command (its default when
/// absent).
fn health_addr(command: &[String]) -> SocketAddr {
    let addr = command
        .windows(2)
        .find(|pair| pair[0] == "--addr")
        .map_or("127.0.0.1:50051", |pair| pair[1].as_str());
    addr.parse()
        .unwrap_or_else(|_| panic!("{command:?}: --addr {addr:?} is not an address"))
}

/// The value of `--config` in a `retryd serve` command line.
fn config_flag(command: &[String]) -> Option<String> {
    command
        .windows(2)
        .find(|pair| pair[0] == "--config" || pair[0] == "-c")
        .map(|pair| pair[1].clone())
}

/// The validated configuration retryd would run on with this file and
/// these `RETRYD__` variables (and no others).
fn config_of(label: &str, toml: &str, environment: &HashMap<String, String>) -> Config {
    Settings::from_sources(toml, Some(environment.clone()))
        .and_then(Config::try_from)
        .unwrap_or_else(|err| panic!("{label}: {err}"))
}

/// Runs the real binary: `retryd check-config FILE` on `toml` written to a
/// temporary file, with exactly `environment` as its `RETRYD__` variables.
fn check_config(label: &str, toml: &str, environment: &HashMap<String, String>) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("retryd.toml");
    std::fs::write(&file, toml).unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_retryd"));
    command.arg("check-config").arg(&file);
    // Only the deployment's own variables: none inherited from this shell.
    for (name, _) in std::env::vars_os() {
        if name
            .to_str()
            .is_some_and(|name| name.to_ascii_uppercase().starts_with("RETRYD__"))
        {
            command.env_remove(name);
        }
    }
    command.envs(environment);
    let output = command.output().expect("retryd check-config runs");
    assert!(
        output.status.success(),
        "retryd check-config refused {label} (environment {environment:?}):\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
}

fn host_of(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = rest.split('/').next().unwrap_or(rest);
    let host_port = authority
        .rsplit_once('@')
        .map_or(authority, |(_, host)| host);
    host_port
        .rsplit_once(':')
        .map_or(host_port, |(host, _)| host)
}

/// A Kubernetes quantity (`250m`, `1`, `64Mi`, `1G`) as a number.
fn quantity(raw: &str) -> f64 {
    let suffixes: [(&str, f64); 10] = [
        ("Ki", 1024.0),
        ("Mi", 1024.0 * 1024.0),
        ("Gi", 1024.0 * 1024.0 * 1024.0),
        ("Ti", 1024.0 * 1024.0 * 1024.0 * 1024.0),
        ("m", 0.001),
        ("k", 1e3),
        ("M", 1e6),
        ("G", 1e9),
        ("T", 1e12),
        ("", 1.0),
    ];
    let (number, factor) = suffixes
        .iter()
        .find_map(|(suffix, factor)| raw.strip_suffix(suffix).map(|number| (number, *factor)))
        .expect("the empty suffix always matches");
    number
        .parse::<f64>()
        .map(|number| number * factor)
        .unwrap_or_else(|_| panic!("{raw:?} is not a Kubernetes quantity"))
}

// ------------------------------------------------------------- kubernetes

fn k8s_dir() -> PathBuf {
    deploy_dir().join("k8s")
}

fn kustomization() -> Yaml {
    load_one(&k8s_dir().join("kustomization.yaml"))
}

/// The files the kustomization lists as resources.
fn resource_files() -> Vec<PathBuf> {
    seq(&kustomization()["resources"], "kustomization resources")
        .iter()
        .map(|entry| k8s_dir().join(text(entry, "kustomization resource")))
        .collect()
}

/// Every object the kustomize base renders from its resource files.
fn base_objects() -> Vec<Yaml> {
    resource_files()
        .iter()
        .flat_map(|path| load(path))
        .collect()
}

/// Every object in deploy/k8s, including examples kept out of the base.
fn all_k8s_objects() -> Vec<Yaml> {
    yaml_files(&k8s_dir())
        .iter()
        .filter(|path| path.file_name().unwrap() != "kustomization.yaml")
        .flat_map(|path| load(path))
        .collect()
}

fn the_one<'a>(objects: &'a [Yaml], kind: &str) -> &'a Yaml {
    let found: Vec<_> = objects
        .iter()
        .filter(|object| object["kind"].as_str() == Some(kind))
        .collect();
    assert_eq!(found.len(), 1, "expected exactly one {kind} in the base");
    found[0]
}

/// ConfigMaps by name, with their data: from `configMapGenerator` (file
/// sources `key=path` or `path`, literals `key=value`) and from ConfigMap
/// resources.
fn config_maps() -> BTreeMap<String, BTreeMap<String, String>> {
    let mut maps: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    if let Some(generators) = kustomization()["configMapGenerator"].as_vec() {
        for generator in generators {
            let name = text(&generator["name"], "configMapGenerator name").to_owned();
            let data = maps.entry(name).or_default();
            for file in generator["files"].as_vec().into_iter().flatten() {
                let source = text(file, "configMapGenerator file");
                let (key, path) = source.split_once('=').unwrap_or_else(|| {
                    let key = Path::new(source).file_name().unwrap().to_str().unwrap();
                    (key, source)
                });
                data.insert(key.to_owned(), read(&k8s_dir().join(path)));
            }
            for literal in generator["literals"].as_vec().into_iter().flatten() {
                let (key, value) = text(literal, "configMapGenerator literal")
                    .split_once('=')
                    .expect("a literal is key=value");
                data.insert(key.to_owned(), value.to_owned());
            }
        }
    }
    for object in base_objects() {
        if object["kind"].as_str() == Some("ConfigMap") {
            let name = text(&object["metadata"]["name"], "ConfigMap name").to_owned();
            let data = maps.entry(name).or_default();
            for (key, value) in entries(&object["data"]) {
                data.insert(key, scalar(value).unwrap_or_default());
            }
        }
    }
    maps
}

/// The Deployment's pod template, and its retryd container.
fn pod_and_container() -> (Yaml, Yaml) {
    let objects = base_objects();
    let pod = the_one(&objects, "Deployment")["spec"]["template"].clone();
    let containers = seq(&pod["spec"]["containers"], "containers");
    let container = containers
        .iter()
        .find(|container| container["name"].as_str() == Some("retryd"))
        .unwrap_or(&containers[0])
        .clone();
    (pod, container)
}

/// The container's `RETRYD__` environment as retryd would see it, with
/// Secret references resolved from the example Secrets in deploy/k8s (the
/// real ones are created out of band).
fn container_environment(container: &Yaml) -> HashMap<String, String> {
    let secrets: Vec<Yaml> = all_k8s_objects()
        .into_iter()
        .filter(|object| object["kind"].as_str() == Some("Secret"))
        .collect();
    let mut environment = HashMap::new();
    for variable in container["env"].as_vec().into_iter().flatten() {
        let name = text(&variable["name"], "env name");
        if !name.starts_with("RETRYD__") {
            continue;
        }
        let value = if let Some(value) = scalar(&variable["value"]) {
            value
        } else if variable["valueFrom"]["secretKeyRef"].is_hash() {
            let reference = &variable["valueFrom"]["secretKeyRef"];
            let secret_name = text(&reference["name"], "secretKeyRef name");
            let key = text(&reference["key"], "secretKeyRef key");
            let secret = secrets
                .iter()
                .find(|secret| secret["metadata"]["name"].as_str() == Some(secret_name))
                .unwrap_or_else(|| {
                    panic!("{name}: no example Secret {secret_name} in deploy/k8s to check with")
                });
            scalar(&secret["stringData"][key]).unwrap_or_else(|| {
                panic!("example Secret {secret_name} has no stringData key {key}")
            })
        } else {
            panic!("{name}: only value and secretKeyRef are checked here");
        };
        environment.insert(name.to_owned(), value);
    }
    environment
}

/// The TOML the pod reads, found by following `--config` through the
/// volume mounts to the ConfigMap and key.
fn pod_config_toml(pod: &Yaml, container: &Yaml) -> String {
    let args = words(&container["args"]);
    let config_path = config_flag(&args).expect("the container passes --config");
    let config_path = Path::new(&config_path);
    let mount = seq(&container["volumeMounts"], "volumeMounts")
        .iter()
        .find(|mount| config_path.starts_with(text(&mount["mountPath"], "mountPath")))
        .unwrap_or_else(|| panic!("no volume is mounted at {}", config_path.display()));
    let relative = config_path
        .strip_prefix(text(&mount["mountPath"], "mountPath"))
        .unwrap()
        .to_str()
        .unwrap()
        .to_owned();
    let volume_name = text(&mount["name"], "volumeMount name");
    let volume = seq(&pod["spec"]["volumes"], "volumes")
        .iter()
        .find(|volume| volume["name"].as_str() == Some(volume_name))
        .unwrap_or_else(|| panic!("no volume {volume_name}"));
    let map_name = text(
        &volume["configMap"]["name"],
        "the config volume's ConfigMap",
    );
    // items: [{key, path}] maps ConfigMap keys to file names.
    let key = volume["configMap"]["items"]
        .as_vec()
        .into_iter()
        .flatten()
        .find(|item| item["path"].as_str() == Some(relative.as_str()))
        .map_or(relative.clone(), |item| {
            text(&item["key"], "item key").to_owned()
        });
    let maps = config_maps();
    let data = maps
        .get(map_name)
        .unwrap_or_else(|| panic!("the base defines no ConfigMap {map_name}"));
    data.get(&key)
        .unwrap_or_else(|| panic!("ConfigMap {map_name} has no key {key}"))
        .clone()
}

fn pod_config() -> (Config, String, HashMap<String, String>) {
    let (pod, container) = pod_and_container();
    let toml = pod_config_toml(&pod, &container);
    let environment = container_environment(&container);
    let config = config_of("the ConfigMap's retryd.toml", &toml, &environment);
    (config, toml, environment)
}

#[test]
fn every_yaml_file_under_deploy_parses() {
    let files = yaml_files(&deploy_dir());
    assert!(
        files.len() >= 9,
        "expected the deploy files, found {files:?}"
    );
    for path in &files {
        let docs = load(path);
        assert!(!docs.is_empty(), "{}: no document", path.display());
        for doc in &docs {
            assert!(
                doc.is_hash(),
                "{}: a document is not a mapping",
                path.display()
            );
        }
    }
    // Kubernetes objects are well-formed: apiVersion, kind, metadata.name.
    for path in yaml_files(&k8s_dir()) {
        for doc in load(&path) {
            for field in ["apiVersion", "kind"] {
                assert!(
                    doc[field].as_str().is_some(),
                    "{}: no {field}",
                    path.display()
                );
            }
            if doc["kind"].as_str() != Some("Kustomization") {
                assert!(
                    doc["metadata"]["name"].as_str().is_some(),
                    "{}: no metadata.name",
                    path.display()
                );
            }
        }
    }
}

#[test]
fn every_kustomization_file_exists_and_every_manifest_is_listed() {
    let listed = resource_files();
    for path in &listed {
        assert!(
            path.is_file(),
            "kustomization resource {} is missing",
            path.display()
        );
        assert!(!load(path).is_empty(), "{} holds no object", path.display());
    }
    for generator in kustomization()["configMapGenerator"]
        .as_vec()
        .into_iter()
        .flatten()
    {
        for file in generator["files"].as_vec().into_iter().flatten() {
            let source = text(file, "configMapGenerator file");
            let path = source.split_once('=').map_or(source, |(_, path)| path);
            assert!(
                k8s_dir().join(path).is_file(),
                "generator file {path} is missing"
            );
        }
    }
    // Nothing forgotten: every manifest but examples is part of the base.
    for path in yaml_files(&k8s_dir()) {
        let name = path.file_name().unwrap().to_str().unwrap();
        if name == "kustomization.yaml" || name.ends_with(".example.yaml") {
            continue;
        }
        assert!(
            listed.contains(&path),
            "{name} is not in kustomization.yaml resources"
        );
    }
    let objects = base_objects();
    for kind in [
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
    ] {
        the_one(&objects, kind);
    }
    assert!(
        !objects
            .iter()
            .any(|object| object["kind"].as_str() == Some("Secret")),
        "no Secret (no credential) is committed into the base"
    );
}

#[test]
fn deployment_probes_ask_the_grpc_health_service() {
    let (config, _, _) = pod_config();
    let (_, container) = pod_and_container();
    for probe_name in ["readinessProbe", "livenessProbe"] {
        let probe = &container[probe_name];
        assert!(!probe.is_badvalue(), "the container has no {probe_name}");
    }
    for probe_name in ["startupProbe", "readinessProbe", "livenessProbe"] {
        let probe = &container[probe_name];
        if probe.is_badvalue() {
            continue;
        }
        if probe["grpc"].is_hash() {
            assert_eq!(
                probe["grpc"]["port"].as_i64(),
                Some(i64::from(config.listen.port())),
                "{probe_name} asks the gRPC port of server.listen"
            );
            assert_eq!(
                probe["grpc"]["service"].as_str(),
                Some(HEALTH_SERVICE),
                "{probe_name} asks the service that turns NOT_SERVING on drain"
            );
        } else {
            let command = words(&probe["exec"]["command"]);
            assert!(
                is_retryd_health(&command),
                "{probe_name} is neither a grpc probe nor exec `retryd health`: {command:?}"
            );
            assert_eq!(health_addr(&command).port(), config.listen.port());
        }
    }
}

#[test]
fn deployment_ports_match_the_configuration() {
    let (config, _, _) = pod_config();
    let (pod, container) = pod_and_container();
    assert!(
        config.listen.ip().is_unspecified() && config.metrics_listen.ip().is_unspecified(),
        "in a pod, retryd must listen on all interfaces (0.0.0.0), not {} / {}",
        config.listen,
        config.metrics_listen
    );
    let ports: BTreeMap<String, i64> = seq(&container["ports"], "ports")
        .iter()
        .map(|port| {
            (
                text(&port["name"], "port name").to_owned(),
                port["containerPort"].as_i64().expect("containerPort"),
            )
        })
        .collect();
    assert_eq!(ports.get("grpc"), Some(&i64::from(config.listen.port())));
    assert_eq!(
        ports.get("metrics"),
        Some(&i64::from(config.metrics_listen.port()))
    );

    let objects = base_objects();
    let pod_labels = entries(&pod["metadata"]["labels"]);
    let selects_pods = |selector: &Yaml, what: &str| {
        let wanted = entries(selector);
        assert!(!wanted.is_empty(), "{what} selects nothing");
        for (key, value) in wanted {
            assert!(
                pod_labels
                    .iter()
                    .any(|(label, own)| *label == key && *own == value),
                "{what} selects {key}={value:?}, which the pods do not carry"
            );
        }
    };
    let deployment = the_one(&objects, "Deployment");
    selects_pods(
        &deployment["spec"]["selector"]["matchLabels"],
        "the Deployment",
    );

    let service = the_one(&objects, "Service");
    selects_pods(&service["spec"]["selector"], "the Service");
    let mut service_ports = BTreeMap::new();
    for port in seq(&service["spec"]["ports"], "Service ports") {
        let target = scalar(&port["targetPort"]).expect("targetPort");
        let container_port = ports
            .get(&target)
            .copied()
            .or_else(|| target.parse().ok())
            .unwrap_or_else(|| panic!("Service targetPort {target} is not a container port"));
        assert!(
            ports.values().any(|port| *port == container_port),
            "Service targetPort {target} is not a container port"
        );
        service_ports.insert(container_port, port["port"].as_i64().expect("port"));
    }
    assert_eq!(
        service_ports.get(&50051),
        Some(&50051),
        "Service exposes gRPC"
    );
    assert_eq!(
        service_ports.get(&9464),
        Some(&9464),
        "Service exposes metrics"
    );

    let budget = the_one(&objects, "PodDisruptionBudget");
    assert_eq!(budget["apiVersion"].as_str(), Some("policy/v1"));
    selects_pods(
        &budget["spec"]["selector"]["matchLabels"],
        "the PodDisruptionBudget",
    );
    let replicas = deployment["spec"]["replicas"].as_i64().expect("replicas");
    assert_eq!(replicas, 3);
    match (
        budget["spec"]["maxUnavailable"].as_i64(),
        budget["spec"]["minAvailable"].as_i64(),
    ) {
        (Some(max_unavailable), _) => assert!((1..replicas).contains(&max_unavailable)),
        (None, Some(min_available)) => assert!((1..replicas).contains(&min_available)),
        _ => panic!("the PodDisruptionBudget sets maxUnavailable or minAvailable as a count"),
    }

    let autoscaler = the_one(&objects, "HorizontalPodAutoscaler");
    assert_eq!(autoscaler["apiVersion"].as_str(), Some("autoscaling/v2"));
    let target = &autoscaler["spec"]["scaleTargetRef"];
    assert_eq!(target["kind"].as_str(), Some("Deployment"));
    assert_eq!(target["name"], deployment["metadata"]["name"]);
    let min = autoscaler["spec"]["minReplicas"]
        .as_i64()
        .expect("minReplicas");
    let max = autoscaler["spec"]["maxReplicas"]
        .as_i64()
        .expect("maxReplicas");
    assert!(
        min >= 2 && min <= replicas && replicas <= max,
        "{min} ≤ {replicas} ≤ {max}"
    );
    assert!(
        seq(&autoscaler["spec"]["metrics"], "HPA metrics")
            .iter()
            .any(|metric| metric["resource"]["name"].as_str() == Some("cpu")
                && metric["resource"]["target"]["averageUtilization"]
                    .as_i64()
                    .is_some()),
        "the autoscaler scales on CPU utilization"
    );
}

#[test]
fn deployment_runs_unprivileged() {
    let (pod, container) = pod_and_container();
    let pod_security = &pod["spec"]["securityContext"];
    let security = &container["securityContext"];
    // A container setting wins over the pod's.
    let effective = |field: &str| {
        if security[field].is_badvalue() {
            pod_security[field].clone()
        } else {
            security[field].clone()
        }
    };
    assert_eq!(
        effective("runAsNonRoot").as_bool(),
        Some(true),
        "runAsNonRoot"
    );
    if let Some(user) = effective("runAsUser").as_i64() {
        assert_ne!(user, 0, "runAsUser is root");
    }
    assert_eq!(
        effective("seccompProfile")["type"].as_str(),
        Some("RuntimeDefault"),
        "seccompProfile"
    );
    assert_eq!(security["readOnlyRootFilesystem"].as_bool(), Some(true));
    assert_eq!(security["allowPrivilegeEscalation"].as_bool(), Some(false));
    assert_ne!(security["privileged"].as_bool(), Some(true));
    assert!(
        words(&security["capabilities"]["drop"]).contains(&"ALL".to_owned()),
        "capabilities drop ALL"
    );
    assert!(
        security["capabilities"]["add"].is_badvalue(),
        "no capability is added back"
    );
    assert_ne!(pod["spec"]["hostNetwork"].as_bool(), Some(true));
}

#[test]
fn deployment_sets_resource_requests_and_limits() {
    let (_, container) = pod_and_container();
    let resources = &container["resources"];
    for resource in ["cpu", "memory"] {
        let request = scalar(&resources["requests"][resource])
            .unwrap_or_else(|| panic!("no {resource} request"));
        let limit =
            scalar(&resources["limits"][resource]).unwrap_or_else(|| panic!("no {resource} limit"));
        let (request, limit) = (quantity(&request), quantity(&limit));
        assert!(
            request > 0.0 && request <= limit,
            "{resource}: request {request} must be positive and at most the limit {limit}"
        );
    }
}

#[test]
fn termination_outlasts_the_prestop_sleep_and_the_drain() {
    let (config, _, _) = pod_config();
    let (pod, container) = pod_and_container();
    let grace = pod["spec"]["terminationGracePeriodSeconds"]
        .as_i64()
        .expect("terminationGracePeriodSeconds is set");
    let pre_stop = &container["lifecycle"]["preStop"];
    let sleep = if let Some(seconds) = pre_stop["sleep"]["seconds"].as_i64() {
        seconds
    } else {
        let command = words(&pre_stop["exec"]["command"]);
        match command.iter().position(|word| word.ends_with("sleep")) {
            Some(at) => command[at + 1].parse().expect("sleep seconds"),
            None => 0,
        }
    };
    assert!(
        sleep > 0,
        "a preStop sleep lets endpoints drop the pod before SIGTERM"
    );
    let needed = Duration::from_secs(sleep as u64) + config.shutdown_grace;
    assert!(
        Duration::from_secs(grace as u64) > needed,
        "terminationGracePeriodSeconds {grace} must exceed the preStop sleep ({sleep}s) plus \
         server.shutdown_grace ({:?})",
        config.shutdown_grace
    );
}

#[test]
fn the_redis_url_comes_from_a_secret() {
    let (pod, container) = pod_and_container();
    let toml = pod_config_toml(&pod, &container);
    let from_file = Settings::from_sources(&toml, Some(HashMap::new())).unwrap();
    assert_eq!(
        from_file.store.kind,
        StoreKind::Redis,
        "the pods share budgets through Redis"
    );
    assert_eq!(
        from_file.store.url, None,
        "the ConfigMap must not hold the Redis URL (it may carry a password)"
    );
    let variables = seq(&container["env"], "env");
    let url = variables
        .iter()
        .find(|variable| variable["name"].as_str() == Some("RETRYD__STORE__URL"))
        .expect("RETRYD__STORE__URL is set");
    let reference = &url["valueFrom"]["secretKeyRef"];
    assert!(
        reference["name"].as_str().is_some() && reference["key"].as_str().is_some(),
        "RETRYD__STORE__URL comes from a secretKeyRef, not {url:?}"
    );
    assert_ne!(reference["optional"].as_bool(), Some(true));
    for variable in variables {
        let value = scalar(&variable["value"]).unwrap_or_default();
        assert!(
            !value.starts_with("redis://") && !value.starts_with("rediss://"),
            "a Redis URL in plain env: {variable:?}"
        );
    }
    // With the Secret's value, retryd runs on the shared store.
    let (config, _, _) = pod_config();
    assert!(matches!(
        config.store,
        retryd::config::StoreConfig::Redis(_)
    ));
}

#[test]
fn the_configmap_toml_passes_check_config() {
    let (_, toml, environment) = pod_config();
    assert!(environment.contains_key("RETRYD__STORE__URL"));
    check_config("the ConfigMap's retryd.toml", &toml, &environment);
}

// ---------------------------------------------------------------- compose

fn compose() -> Yaml {
    load_one(&deploy_dir().join("compose.yaml"))
}

/// The services built from deploy/Dockerfile or running a retryd image.
fn retryd_services(compose: &Yaml) -> Vec<(String, Yaml)> {
    entries(&compose["services"])
        .into_iter()
        .filter(|(_, service)| {
            service["build"]["dockerfile"].as_str() == Some("deploy/Dockerfile")
                || service["image"]
                    .as_str()
                    .is_some_and(|image| image.starts_with("retryd:"))
        })
        .map(|(name, service)| (name, service.clone()))
        .collect()
}

fn service_environment(service: &Yaml) -> HashMap<String, String> {
    let mut environment = HashMap::new();
    match &service["environment"] {
        Yaml::Array(items) => {
            for item in items {
                let item = text(item, "environment entry");
                let (name, value) = item.split_once('=').unwrap_or((item, ""));
                environment.insert(name.to_owned(), value.to_owned());
            }
        }
        other => {
            for (name, value) in entries(other) {
                environment.insert(name, scalar(value).unwrap_or_default());
            }
        }
    }
    environment.retain(|name, _| name.starts_with("RETRYD__"));
    environment
}

/// Bind mounts of a service as (host path under deploy/, container path).
fn bind_mounts(service: &Yaml) -> Vec<(PathBuf, String)> {
    service["volumes"]
        .as_vec()
        .into_iter()
        .flatten()
        .filter_map(|volume| {
            let (source, target) = match volume {
                Yaml::String(short) => {
                    let mut parts = short.split(':');
                    (parts.next()?.to_owned(), parts.next()?.to_owned())
                }
                long => (
                    long["source"].as_str()?.to_owned(),
                    long["target"].as_str()?.to_owned(),
                ),
            };
            (source.starts_with("./") || source.starts_with("../"))
                .then(|| (deploy_dir().join(source), target))
        })
        .collect()
}

/// The host file mounted at `target` in `service`.
fn mounted_file(service_name: &str, service: &Yaml, target: &str) -> PathBuf {
    bind_mounts(service)
        .into_iter()
        .find(|(_, mounted_at)| mounted_at == target)
        .map(|(source, _)| source)
        .unwrap_or_else(|| panic!("{service_name}: nothing is mounted at {target}"))
}

/// The retryd configuration a Compose service runs on: the file it mounts
/// where its command's `--config` points, with its `RETRYD__` variables.
fn compose_retryd_config(name: &str, service: &Yaml) -> (String, HashMap<String, String>) {
    let command = words(&service["command"]);
    let path = config_flag(&command).unwrap_or_else(|| "/etc/retryd/retryd.toml".to_owned());
    let toml = read(&mounted_file(name, service, &path));
    (toml, service_environment(service))
}

#[test]
fn compose_runs_two_healthchecked_retryd_replicas_on_redis() {
    let compose = compose();
    let services = entries(&compose["services"]);
    let names: Vec<&str> = services.iter().map(|(name, _)| name.as_str()).collect();
    let replicas = retryd_services(&compose);
    assert!(
        replicas.len() >= 2,
        "two retryd replicas, found {replicas:?}"
    );
    for wanted in ["redis", "otel-collector", "jaeger", "prometheus"] {
        assert!(names.contains(&wanted), "the stack has no {wanted} service");
    }
    let redis = &compose["services"]["redis"];
    assert!(
        !words(&redis["healthcheck"]["test"]).is_empty(),
        "redis has a healthcheck, so retryd can wait for it"
    );

    let mut published = Vec::new();
    for (name, service) in &replicas {
        let (toml, environment) = compose_retryd_config(name, service);
        let config = config_of(name, &toml, &environment);

        let test = words(&service["healthcheck"]["test"]);
        assert!(
            is_retryd_health(&test),
            "{name}: the healthcheck runs `retryd health`, not {test:?}"
        );
        assert_eq!(health_addr(&test).port(), config.listen.port(), "{name}");
        assert!(
            config.listen.ip().is_unspecified(),
            "{name}: in a container retryd must listen on 0.0.0.0, not {}",
            config.listen
        );

        let depends_on = &service["depends_on"];
        match depends_on {
            Yaml::Array(list) => assert!(
                list.iter().any(|item| item.as_str() == Some("redis")),
                "{name} depends on redis"
            ),
            map => assert_eq!(
                map["redis"]["condition"].as_str(),
                Some("service_healthy"),
                "{name} waits for a healthy redis"
            ),
        }

        let retryd::config::StoreConfig::Redis(store) = &config.store else {
            panic!("{name}: the replicas must share a Redis store");
        };
        for url in &store.urls {
            assert!(
                names.contains(&host_of(url.expose_credentials())),
                "{name}: {url} is not a service"
            );
        }
        let endpoint = config
            .telemetry
            .otlp
            .as_ref()
            .map(|export| export.endpoint.as_str())
            .unwrap_or_else(|| panic!("{name}: no otlp_endpoint"));
        assert!(
            names.contains(&host_of(endpoint)),
            "{name}: {endpoint} is not a service"
        );

        // Docker's default is 10s: the drain needs more than shutdown_grace.
        let stop = service["stop_grace_period"]
            .as_str()
            .map_or(Duration::from_secs(10), |raw| {
                humantime::parse_duration(raw).expect("stop_grace_period")
            });
        assert!(
            stop > config.shutdown_grace,
            "{name}: stop_grace_period {stop:?} must exceed shutdown_grace {:?}",
            config.shutdown_grace
        );

        for port in words(&service["ports"]) {
            let host_side: Vec<&str> = port.split(':').collect();
            assert_eq!(
                host_side.len(),
                3,
                "{name}: publish {port} on an explicit host address (no auth)"
            );
            assert_eq!(host_side[0], "127.0.0.1", "{name}: {port} beyond loopback");
            published.push(host_side[1].to_owned());
        }
    }
    let mut unique = published.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(
        unique.len(),
        published.len(),
        "host ports collide: {published:?}"
    );
}

#[test]
fn compose_bind_mounts_exist_and_observability_is_wired() {
    let compose = compose();
    for (name, service) in entries(&compose["services"]) {
        for (source, _) in bind_mounts(service) {
            assert!(
                source.is_file(),
                "{name}: {} does not exist",
                source.display()
            );
        }
    }

    // Prometheus scrapes every replica's metrics port.
    let prometheus = &compose["services"]["prometheus"];
    let config = load_one(&mounted_file(
        "prometheus",
        prometheus,
        "/etc/prometheus/prometheus.yml",
    ));
    let targets: Vec<String> = seq(&config["scrape_configs"], "scrape_configs")
        .iter()
        .flat_map(|job| job["static_configs"].as_vec().cloned().unwrap_or_default())
        .flat_map(|group| words(&group["targets"]))
        .collect();
    for (name, service) in retryd_services(&compose) {
        let (toml, environment) = compose_retryd_config(&name, &service);
        let metrics = config_of(&name, &toml, &environment).metrics_listen;
        let target = format!("{name}:{}", metrics.port());
        assert!(
            targets.contains(&target),
            "Prometheus does not scrape {target}"
        );
    }

    // The collector receives OTLP/gRPC where retryd sends it and forwards
    // traces to Jaeger over OTLP.
    let collector = &compose["services"]["otel-collector"];
    let command = words(&collector["command"]);
    let config_path = command
        .iter()
        .find_map(|word| word.strip_prefix("--config="))
        .expect("the collector is given --config=");
    let config = load_one(&mounted_file("otel-collector", collector, config_path));
    let grpc = text(
        &config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"],
        "OTLP gRPC receiver endpoint",
    );
    assert!(grpc.ends_with(":4317"), "{grpc}");
    let pipeline = &config["service"]["pipelines"]["traces"];
    assert!(words(&pipeline["receivers"]).contains(&"otlp".to_owned()));
    let exporters = words(&pipeline["exporters"]);
    assert!(
        exporters.iter().any(|exporter| {
            let defined = &config["exporters"][exporter.as_str()];
            exporter.starts_with("otlp")
                && defined["endpoint"]
                    .as_str()
                    .is_some_and(|endpoint| host_of(endpoint) == "jaeger")
        }),
        "the traces pipeline exports to jaeger over OTLP: {exporters:?}"
    );
    for processor in words(&pipeline["processors"]) {
        assert!(
            !config["processors"][processor.as_str()].is_badvalue(),
            "processor {processor} is not defined"
        );
    }
}

#[test]
fn the_compose_toml_passes_check_config() {
    let compose = compose();
    let path = deploy_dir().join("compose/retryd.toml");
    let toml = read(&path);
    let settings = Settings::from_sources(&toml, Some(HashMap::new())).unwrap();
    assert_eq!(settings.store.kind, StoreKind::Redis);
    assert_eq!(settings.store.mode, StoreMode::Leased);
    assert_eq!(
        settings.store.url,
        Some(Urls::One("redis://redis:6379".to_owned()))
    );
    assert_eq!(
        settings.telemetry.otlp_endpoint.as_deref(),
        Some("http://otel-collector:4317")
    );
    check_config("deploy/compose/retryd.toml", &toml, &HashMap::new());
    // And as each replica runs it, with its own environment.
    for (name, service) in retryd_services(&compose) {
        let (toml, environment) = compose_retryd_config(&name, &service);
        check_config(&format!("compose service {name}"), &toml, &environment);
    }
}

// ------------------------------------------------------------- dockerfile

/// Dockerfile instructions (continuation lines joined, comments dropped),
/// grouped by stage.
fn dockerfile_stages() -> Vec<Vec<(String, String)>> {
    let mut stages: Vec<Vec<(String, String)>> = Vec::new();
    let mut logical = String::new();
    for line in read(&deploy_dir().join("Dockerfile")).lines() {
        let trimmed = line.trim();
        if trimmed.starts_with('#') || (trimmed.is_empty() && logical.is_empty()) {
            continue;
        }
        if let Some(continued) = trimmed.strip_suffix('\\') {
            logical.push_str(continued);
            logical.push(' ');
            continue;
        }
        logical.push_str(trimmed);
        let instruction = std::mem::take(&mut logical);
        let (keyword, rest) = instruction
            .split_once(char::is_whitespace)
            .unwrap_or((instruction.as_str(), ""));
        let keyword = keyword.to_ascii_uppercase();
        if keyword == "FROM" {
            stages.push(Vec::new());
        }
        if let Some(stage) = stages.last_mut() {
            stage.push((keyword, rest.trim().to_owned()));
        }
    }
    stages
}

/// An exec-form (`["a", "b"]`) or shell-form argument list.
fn exec_form(rest: &str) -> Vec<String> {
    if rest.starts_with('[') {
        serde_json::from_str(rest).unwrap_or_else(|err| panic!("{rest}: {err}"))
    } else {
        rest.split_whitespace().map(str::to_owned).collect()
    }
}

fn last<'a>(stage: &'a [(String, String)], keyword: &str) -> Option<&'a str> {
    stage
        .iter()
        .rev()
        .find(|(word, _)| word == keyword)
        .map(|(_, rest)| rest.as_str())
}

#[test]
fn dockerfile_builds_like_the_readme_and_runs_unprivileged() {
    let stages = dockerfile_stages();
    assert!(stages.len() >= 2, "a multi-stage build");
    let builder = &stages[0];
    assert!(
        builder.iter().any(|(keyword, rest)| keyword == "RUN"
            && rest.contains("cargo build --release --locked --bin retryd")),
        "the builder runs `cargo build --release --locked --bin retryd`"
    );
    let runtime = stages.last().unwrap();

    let user = last(runtime, "USER").expect("the runtime stage sets USER");
    let uid = user.split(':').next().unwrap();
    assert!(!matches!(uid, "root" | "0" | ""), "USER {user} is root");
    assert!(
        uid.parse::<u32>().is_ok(),
        "USER {user} is numeric, so runAsNonRoot can verify it"
    );

    let healthcheck = last(runtime, "HEALTHCHECK").expect("the runtime stage has a HEALTHCHECK");
    let command = healthcheck
        .split_once("CMD")
        .map(|(_, command)| exec_form(command.trim()))
        .expect("HEALTHCHECK CMD");
    assert!(
        is_retryd_health(&command),
        "HEALTHCHECK runs `retryd health`: {command:?}"
    );

    let exposed: Vec<&str> = runtime
        .iter()
        .filter(|(keyword, _)| keyword == "EXPOSE")
        .flat_map(|(_, rest)| rest.split_whitespace())
        .collect();
    for port in ["50051", "9464"] {
        assert!(exposed.contains(&port), "EXPOSE {port}");
    }

    let mut argv = exec_form(last(runtime, "ENTRYPOINT").expect("ENTRYPOINT"));
    argv.extend(exec_form(last(runtime, "CMD").unwrap_or("[]")));
    assert_eq!(
        Path::new(&argv[0])
            .file_name()
            .and_then(|name| name.to_str()),
        Some("retryd")
    );
    assert_eq!(argv[1..], ["serve", "--config", "/etc/retryd/retryd.toml"]);
    assert_eq!(health_addr(&command).port(), 50051);
}

#[test]
fn the_image_default_config_passes_check_config() {
    let stages = dockerfile_stages();
    let runtime = stages.last().unwrap();
    // The file the runtime stage copies to /etc/retryd/retryd.toml.
    let source = runtime
        .iter()
        .filter(|(keyword, _)| keyword == "COPY")
        .map(|(_, rest)| rest.split_whitespace().collect::<Vec<_>>())
        .find(|words| words.last() == Some(&"/etc/retryd/retryd.toml"))
        .map(|words| words[words.len() - 2].to_owned())
        .expect("the image ships /etc/retryd/retryd.toml");
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(&source);
    let toml = read(&path);
    let config = config_of(&source, &toml, &HashMap::new());
    assert_eq!(config.listen, "0.0.0.0:50051".parse().unwrap());
    assert!(config.metrics_listen.ip().is_unspecified());
    check_config(&source, &toml, &HashMap::new());

    // And the build context lets it (and the sources) through.
    let ignore = read(&Path::new(env!("CARGO_MANIFEST_DIR")).join(".dockerignore"));
    let lines: Vec<&str> = ignore.lines().map(str::trim).collect();
    if lines.contains(&"*") {
        for needed in ["Cargo.toml", "Cargo.lock", "crates/", "proto/", "src/"] {
            assert!(
                lines.contains(&format!("!{needed}").as_str()),
                ".dockerignore must let {needed} through"
            );
        }
        assert!(
            lines.contains(&format!("!{source}").as_str()),
            ".dockerignore must let {source} through"
        );
    } else {
        assert!(
            lines.iter().any(|line| line.trim_matches('/') == "target"),
            ".dockerignore keeps target/ out of the build context"
        );
    }
}
