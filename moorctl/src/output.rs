//! Printing answers: aligned tables and sentences for people, one JSON document for scripts.

use std::io::Write;

use serde_json::Value;

use crate::cli::Output;

/// A table: a header row and rows of cells.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Table {
    /// Column titles.
    pub headers: Vec<String>,
    /// Rows; a short row is padded with empty cells.
    pub rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these column titles.
    pub fn new(headers: &[&str]) -> Self {
        Self {
            headers: headers.iter().map(|h| (*h).to_string()).collect(),
            rows: Vec::new(),
        }
    }

    /// Adds a row.
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// The table as text: columns padded to their widest cell, two spaces apart, no trailing
    /// spaces. A cell's newlines and tabs are shown as spaces so a row stays one line.
    pub fn render(&self) -> String {
        let clean = |s: &str| s.replace(['\n', '\t', '\r'], " ");
        let cols = self
            .rows
            .iter()
            .map(Vec::len)
            .chain([self.headers.len()])
            .max()
            .unwrap_or(0);
        let mut widths = vec![0usize; cols];
        for row in std::iter::once(&self.headers).chain(&self.rows) {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(clean(cell).chars().count());
            }
        }
        let mut out = String::new();
        for row in std::iter::once(&self.headers).chain(&self.rows) {
            let mut line = String::new();
            for (i, w) in widths.iter().enumerate() {
                let cell = row.get(i).map(|c| clean(c)).unwrap_or_default();
                if i > 0 {
                    line.push_str("  ");
                }
                line.push_str(&cell);
                line.extend(std::iter::repeat_n(
                    ' ',
                    w.saturating_sub(cell.chars().count()),
                ));
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

/// What a command has to say, in both forms.
#[derive(Debug, Clone)]
pub struct Report {
    /// For people.
    pub human: Human,
    /// For scripts.
    pub json: Value,
}

/// The human form of a report.
#[derive(Debug, Clone)]
pub enum Human {
    /// Lines of text.
    Text(String),
    /// A table, with lines after it.
    Table(Table, String),
}

impl Report {
    /// A sentence and its JSON.
    pub fn text(text: impl Into<String>, json: Value) -> Self {
        Self {
            human: Human::Text(text.into()),
            json,
        }
    }

    /// A table and its JSON.
    pub fn table(table: Table, json: Value) -> Self {
        Self {
            human: Human::Table(table, String::new()),
            json,
        }
    }

    /// The report as printed in `format`.
    pub fn render(&self, format: Output) -> String {
        match format {
            Output::Json => {
                let mut s = serde_json::to_string_pretty(&self.json).unwrap_or_default();
                s.push('\n');
                s
            }
            Output::Table => match &self.human {
                Human::Text(t) if t.is_empty() || t.ends_with('\n') => t.clone(),
                Human::Text(t) => format!("{t}\n"),
                Human::Table(t, after) => {
                    let mut s = t.render();
                    if !after.is_empty() {
                        s.push_str(after);
                        if !after.ends_with('\n') {
                            s.push('\n');
                        }
                    }
                    s
                }
            },
        }
    }

    /// Prints the report on stdout.
    pub fn print(&self, format: Output) -> std::io::Result<()> {
        let mut out = std::io::stdout().lock();
        out.write_all(self.render(format).as_bytes())?;
        out.flush()
    }
}

/// A size in bytes for people: `1.0 GiB (1073741824 bytes)` style, shortened.
pub fn human_bytes(bytes: i64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v.abs() >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    let name = UNITS.get(unit).copied().unwrap_or("B");
    if unit == 0 {
        format!("{bytes} B")
    } else if (v - v.round()).abs() < 0.005 {
        format!("{v:.0} {name}")
    } else {
        format!("{v:.1} {name}")
    }
}

/// `k=v,k2=v2`, sorted, or `-` when empty.
pub fn key_values<'a>(map: impl IntoIterator<Item = (&'a String, &'a String)>) -> String {
    let mut pairs: Vec<String> = map.into_iter().map(|(k, v)| format!("{k}={v}")).collect();
    pairs.sort();
    if pairs.is_empty() {
        "-".into()
    } else {
        pairs.join(",")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tables_align_columns_without_trailing_spaces() {
        let mut t = Table::new(&["ID", "SIZE", "SOURCE"]);
        t.row(vec!["vol-1".into(), "1 GiB".into(), String::new()]);
        t.row(vec!["a-longer-id".into(), "64 MiB".into(), "snap-1".into()]);
        t.row(vec!["short".into()]);
        assert_eq!(
            t.render(),
            "ID           SIZE    SOURCE\n\
             vol-1        1 GiB\n\
             a-longer-id  64 MiB  snap-1\n\
             short\n"
        );
    }

    #[test]
    fn a_cell_never_breaks_its_row() {
        let mut t = Table::new(&["A", "B"]);
        t.row(vec!["x\ny".into(), "z".into()]);
        assert_eq!(t.render(), "A    B\nx y  z\n");
    }

    #[test]
    fn reports_render_as_text_or_json() {
        let r = Report::text("volume vol-1 deleted", json!({"deleted": "vol-1"}));
        assert_eq!(r.render(Output::Table), "volume vol-1 deleted\n");
        assert_eq!(r.render(Output::Json), "{\n  \"deleted\": \"vol-1\"\n}\n");
        let mut t = Table::new(&["K"]);
        t.row(vec!["v".into()]);
        let r = Report {
            human: Human::Table(t, "1 volume".into()),
            json: json!([]),
        };
        assert_eq!(r.render(Output::Table), "K\nv\n1 volume\n");
        assert_eq!(r.render(Output::Json), "[]\n");
    }

    #[test]
    fn byte_sizes_for_people() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(1 << 30), "1 GiB");
        assert_eq!(human_bytes(3 << 19), "1.5 MiB");
        assert_eq!(human_bytes(0), "0 B");
    }

    #[test]
    fn key_value_lists_are_sorted() {
        let m = std::collections::HashMap::from([
            ("devicePath".to_string(), "/dev/loop1".to_string()),
            ("backingFile".to_string(), "/d/v.img".to_string()),
        ]);
        assert_eq!(key_values(&m), "backingFile=/d/v.img,devicePath=/dev/loop1");
        assert_eq!(key_values(&std::collections::HashMap::new()), "-");
    }
}
