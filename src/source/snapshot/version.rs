//! The version a snapshot names: `version.yaml`'s `step` field, as a string.

use std::path::Path;

pub const VERSION_FILE: &str = "version.yaml";

/// `Ok(step)` or `Err(why there is none)`: a missing file, bad YAML, a
/// document that is not a mapping, or no scalar `step` key all mean "no
/// version" (SPEC.md).
pub fn read_version_yaml(dir: &Path) -> Result<String, String> {
    let path = dir.join(VERSION_FILE);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) => return Err(format!("{} could not be read ({e})", path.display())),
    };
    let docs = yaml_rust2::YamlLoader::load_from_str(&text)
        .map_err(|e| format!("{} is not valid YAML ({e})", path.display()))?;
    let Some(doc) = docs.first() else {
        return Err(format!("{} is empty", path.display()));
    };
    if doc.as_hash().is_none() {
        return Err(format!("{} is not a mapping", path.display()));
    }
    let step = &doc["step"];
    use yaml_rust2::Yaml;
    match step {
        Yaml::Integer(i) => Ok(i.to_string()),
        Yaml::String(s) | Yaml::Real(s) if !s.is_empty() => Ok(s.clone()),
        Yaml::BadValue => Err(format!("{} has no 'step' key", path.display())),
        _ => Err(format!(
            "{}: 'step' is not a number or string",
            path.display()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_cases() {
        let d = tempfile::tempdir().unwrap();
        let w = |s: &str| std::fs::write(d.path().join(VERSION_FILE), s).unwrap();
        assert!(read_version_yaml(d.path())
            .unwrap_err()
            .contains("could not be read"));
        w("step: 12345\n");
        assert_eq!(read_version_yaml(d.path()).unwrap(), "12345");
        w("step: run-7\nother: 1\n");
        assert_eq!(read_version_yaml(d.path()).unwrap(), "run-7");
        w("- 1\n- 2\n");
        assert!(read_version_yaml(d.path())
            .unwrap_err()
            .contains("not a mapping"));
        w("foo: 1\n");
        assert!(read_version_yaml(d.path())
            .unwrap_err()
            .contains("no 'step'"));
        w("step: [unclosed\n");
        assert!(read_version_yaml(d.path())
            .unwrap_err()
            .contains("not valid YAML"));
    }
}
