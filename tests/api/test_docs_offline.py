"""``/docs`` and ``/redoc`` load nothing from outside the server (fastapi-offline's assets)."""

import re

import pytest

from moorline.api.docs import CONTENT_SECURITY_POLICY, DOCS_ASSETS_URL
from tests.api.conftest import Api

# Every place an HTML page names something to load: attributes and CSS url(...).
REFERENCE = re.compile(r"""(?:src|href)\s*=\s*["']([^"']+)["']|url\(\s*["']?([^"')]+)""")
SCRIPT_LITERAL = re.compile(r"""["'`](https?:)?//[^"'`\s]+""")


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
async def test_the_docs_page_references_only_the_server_itself(api: Api, page: str) -> None:
    response = await api.client.get(page)
    assert response.status_code == 200, response.text
    html = response.text
    assert response.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    references = [a or b for a, b in REFERENCE.findall(html)]
    assert references, html
    external = [ref for ref in references if re.match(r"^(?:[a-z][a-z0-9+.-]*:)?//", ref, re.I)]
    assert external == [], external
    # And inline script: FastAPI's page passes URLs to Swagger UI / ReDoc as JS strings.
    inline = [match.group(0) for match in SCRIPT_LITERAL.finditer(html)]
    assert inline == [], inline
    # Every local asset it names is served.
    for ref in references:
        if ref.startswith(DOCS_ASSETS_URL) or ref == "/openapi.json":
            loaded = await api.client.get(ref)
            assert loaded.status_code == 200, ref
            assert loaded.content, ref
