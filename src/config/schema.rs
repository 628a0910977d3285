//! The config's JSON Schema (draft 2020-12), derived from the `file` types so it cannot drift
//! from what the parser accepts: `tollgate schema` prints it, editors and CI validate with it.
//!
//! It checks shape (keys, types, unknown keys refused) and the syntax of durations, sizes and
//! rates; what needs the whole file (an upstream that exists, a CIDR that parses) stays
//! `tollgate check`'s. Every string may hold `${VAR}` references, and a number or boolean may be
//! one `${VAR}` alone, as the loader substitutes them before reading the types.

use schemars::transform::{RecursiveTransform, Transform};
use schemars::Schema;
use serde_json::{json, Value};

use super::values::SIZE;

/// One `${VAR}` alone, which may stand where a number or a boolean is expected.
const ONE_REFERENCE: &str = r"^\$\{[A-Za-z_][A-Za-z0-9_]*(?::-[^}]*)?\}$";

/// The schema as a JSON value.
pub fn schema() -> Value {
    let mut schema = schemars::generate::SchemaSettings::draft2020_12()
        .into_generator()
        .into_root_schema_for::<super::file::File>();
    RecursiveTransform(allow_references).transform(&mut schema);
    let mut value = schema.to_value();
    if let Some(root) = value.as_object_mut() {
        root.insert("title".into(), json!("tollgate configuration"));
        root.insert(
            "description".into(),
            json!(
                "The YAML file tollgate loads (docs/configuration.md). Shape and value syntax \
                 only: `tollgate check` also validates what needs the whole file."
            ),
        );
    }
    value
}

/// The schema as `tollgate schema` prints it (and docs/tollgate.schema.json holds it).
pub fn text() -> String {
    let mut text = serde_json::to_string_pretty(&schema()).unwrap_or_default();
    text.push('\n');
    text
}

/// A number or boolean schema also takes a string that is one `${VAR}` reference (`pattern`
/// applies to strings only, `minimum` to numbers only).
fn allow_references(schema: &mut Schema) {
    // A key with a fixed set of words (`x-choices`, set in `file`): offered by editors, and
    // still open to a reference.
    if let Some(Value::Array(words)) = schema.remove("x-choices") {
        let mut any = vec![json!({ "enum": words }), json!({ "pattern": r"\$\{" })];
        if schema
            .get("type")
            .is_some_and(|t| t.to_string().contains("null"))
        {
            any.push(json!({ "type": "null" }));
        }
        schema.insert("anyOf".into(), Value::Array(any));
        return;
    }
    // A size may also be written as a plain number of bytes (`max_body: 1048576`).
    if schema.get("pattern").and_then(Value::as_str) == Some(SIZE) {
        if let Some(Value::Array(types)) = schema.get_mut("type") {
            types.insert(1, json!("integer"));
        } else {
            schema.insert("type".into(), json!(["string", "integer"]));
        }
        schema.insert("minimum".into(), json!(0));
        return;
    }
    let scalar = |t: &Value| matches!(t.as_str(), Some("integer" | "number" | "boolean"));
    let Some(types) = schema.get("type").cloned() else {
        return;
    };
    let types = match types {
        Value::String(_) => vec![types],
        Value::Array(v) => v,
        _ => return,
    };
    if !types.iter().any(scalar) || types.iter().any(|t| t == "string") {
        return;
    }
    // A quoted number or boolean is read as the value it spells (`burst: "20"`), as `check`
    // reads it: the loader sees text either way once `${VAR}`s are substituted.
    let spelled = if types.iter().any(|t| t == "boolean") {
        "true|false"
    } else if types.iter().any(|t| t == "number") {
        r"-?[0-9]+(?:\.[0-9]+)?"
    } else {
        "-?[0-9]+"
    };
    let mut types = types;
    types.push(json!("string"));
    schema.insert("type".into(), Value::Array(types));
    schema.insert(
        "pattern".into(),
        json!(format!("^(?:{spelled})$|{ONE_REFERENCE}")),
    );
}
