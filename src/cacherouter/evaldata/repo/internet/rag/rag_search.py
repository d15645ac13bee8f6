"""Search a document collection."""

import argparse
import json

PROJECTS = {
    "rag_project1": [
        "The campus library opens at 8:00.",
        "The campus has four canteens.",
        "BUPT main campus is in Haidian.",
    ],
    "rag_project2": [
        "The mathematics school offers doctoral programmes.",
        "Faculty research covers numerical analysis.",
    ],
}

parser = argparse.ArgumentParser(description="Retrieve passages matching a query from a named RAG project.")
parser.add_argument("query", help="search words")
parser.add_argument("--project", choices=sorted(PROJECTS), default="rag_project1", help="collection to search")
parser.add_argument("--top-k", type=int, default=3, help="maximum passages")
args = parser.parse_args()
words = [w.lower() for w in args.query.split()]
hits = [doc for doc in PROJECTS[args.project] if any(w in doc.lower() for w in words)][: args.top_k]
print(json.dumps({"project": args.project, "hits": len(hits), "passages": hits}))
