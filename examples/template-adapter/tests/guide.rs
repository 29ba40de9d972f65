//! The dlock repository's guide `docs/writing-an-adapter.md` quotes this
//! crate: each code block marked `<!-- excerpt: PATH -->` must still be in
//! PATH word for word. (Outside that repository there is no guide to check.)

use std::path::Path;

#[test]
fn the_guide_quotes_this_crate_as_it_is() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let Ok(guide) = std::fs::read_to_string(root.join("docs/writing-an-adapter.md")) else {
        eprintln!("NOTE no docs/writing-an-adapter.md two levels up: nothing to check");
        return;
    };
    let mut lines = guide.lines();
    let mut checked = 0;
    while let Some(line) = lines.next() {
        let Some(path) = line.strip_prefix("<!-- excerpt: ") else {
            continue;
        };
        let path = path.trim_end_matches(" -->");
        assert!(
            lines.next().is_some_and(|l| l.starts_with("```")),
            "{path}: no code block"
        );
        let excerpt: Vec<&str> = lines.by_ref().take_while(|l| *l != "```").collect();
        let file = std::fs::read_to_string(root.join(path)).expect(path);
        assert!(
            file.contains(&excerpt.join("\n")),
            "the guide's excerpt of {path} is not in it"
        );
        checked += 1;
    }
    assert!(checked >= 5, "only {checked} excerpts found");
}
